"""TOVA: keep the entries the current query attends to most, averaged over all heads (policies.md §4)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.allocators import RULES
from kvjax.policies.base import (
    DecodeState,
    Plan,
    PlanRequest,
    Policy,
    Requirements,
    as_i32,
    check_bool,
    check_choice,
    select,
)
from kvjax.policies.scoring import attention_scale, last_window, window_moments


@dataclasses.dataclass(frozen=True, kw_only=True)
class TOVA(Policy):
    """Score = the last query's softmax row, averaged over ALL query heads of the layer: one kept
    set shared by every KV head (so all heads keep the same slot layout).

    Paper (decode=True): evicts at prefill (scored by the last prompt query, its own column
    included, so it may go) and after every decode step; capacity budget + 1; no protection.
    `tova_kvpress`: decode=False, protect_last=True (the last prompt token is always kept),
    rule="kvpress" (n_kept = int(T(1-r))).
    """

    name = "tova"
    chunked_prefill_reason = None

    decode: bool = True
    protect_last: bool = False
    rule: str = "paper"
    use_model_scale: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool("decode", self.decode)
        check_bool("protect_last", self.protect_last)
        check_choice("rule", self.rule, RULES)
        check_bool("use_model_scale", self.use_model_scale)

    def requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(window=1, step_probs=self.decode), decode_eviction=self.decode)

    def build_plan(self, req: PlanRequest) -> Plan:
        lengths, num_layers = req.lengths, req.num_layers
        budgets = req.row_budgets(self.kvpress_compat)
        if self.rule == "paper" and self.protect_last and min(budgets) < 2:
            raise ValueError("TOVA(protect_last=True): budget must exceed the 1 protected token")
        counts = [min(c, t) for c, t in zip(budgets, lengths)]
        return req.finish(
            [counts] * num_layers,
            decode_budget=budgets if self.decode else (),
            capacity=max(budgets) + 1 + req.question_tokens if self.decode else max(counts) + req.max_new_tokens,
            evicts=any(c < t for c, t in zip(counts, lengths)),
        )

    def prefill_scores(self, plan: Plan, cache: KVCache, obs: Observations) -> jax.Array:
        """Mean over all query heads of the last prompt query's probabilities, [L,B,Hkv,C]."""
        q, qpos = last_window(obs, 1)
        scale = attention_scale(obs, cache.k.shape[-1], self.use_model_scale)
        m = window_moments(q, qpos, cache, scale=scale, group_reduce="mean", moments=("sum",))["sum"]
        return jnp.broadcast_to(m.mean(2, keepdims=True), m.shape)

    def prefill_keep(self, plan: Plan, cache: KVCache, obs: Observations) -> tuple[jax.Array, None]:
        s = self.prefill_scores(plan, cache, obs)
        prot = None
        if self.protect_last:
            prot = cache.valid & (cache.pos == as_i32(plan.lengths)[None, :, None, None] - 1)
        counts = as_i32(plan.counts)[..., None]
        return select(s, cache.valid, counts, pos=cache.pos, protected=prot), None

    def decode_update(
        self, plan: Plan, state: DecodeState, cache: KVCache, step_probs: jax.Array, written: jax.Array, t: jax.Array
    ) -> tuple[DecodeState, jax.Array]:
        if not self.decode:
            return state, cache.valid
        s = step_probs.astype(jnp.float32).mean((2, 3), keepdims=True)[:, :, :, 0]
        s = jnp.broadcast_to(s, cache.valid.shape)
        budget = as_i32(plan.decode_budget)[None, :, None]
        over = jnp.any(cache.valid.sum(-1) > budget)
        keep = jax.lax.cond(over, lambda: select(s, cache.valid, budget, pos=cache.pos), lambda: cache.valid)
        return state, keep
