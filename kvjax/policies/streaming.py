"""StreamingLLM: attention sinks plus the most recent tokens (policies.md §2)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations
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
    check_int,
    select,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLM(Policy):
    """Keeps the first `n_sink` positions and the most recent tokens; identical for all heads.

    Paper (decode=True): the original evicts *before* each write so that attention never sees
    more than `budget` entries. The engine writes first, so the policy keeps budget - 1 entries
    (sinks + newest) after prefill and after every step: capacity = budget, and each step's
    attention sees exactly sinks + the budget - n_sink newest tokens, as in the original.
    rope_mode="cache_relative" (the original's pos_shift): the model caches keys un-rotated and, at
    every step, rotates each kept key at its rank among the kept entries and the query at its own.
    `streaming_llm_kvpress`: decode=False, rope_mode="original", rule="kvpress": keeps
    [0, n_sink) and [n_sink + n_pruned, T) with n_pruned = T - int(T(1-r)); requires T > n_sink.
    """

    name = "streaming_llm"
    chunked_prefill_reason = None

    n_sink: int = 4
    decode: bool = True
    rope_mode: str = "cache_relative"
    rule: str = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_sink", self.n_sink, 0)
        check_bool("decode", self.decode)
        check_choice("rope_mode", self.rope_mode, ("cache_relative", "original"))
        check_choice("rule", self.rule, RULES)

    def requirements(self) -> Requirements:
        return Requirements(decode_eviction=self.decode, rope_mode=self.rope_mode)

    def build_plan(self, req: PlanRequest) -> Plan:
        lengths, num_layers = req.lengths, req.num_layers
        budgets = req.row_budgets(self.kvpress_compat)
        if self.rule == "kvpress" and min(lengths) <= self.n_sink:
            raise ValueError(f"StreamingLLM(rule='kvpress') needs every prompt longer than n_sink={self.n_sink}")
        if self.rule == "paper" and min(budgets) <= self.n_sink:
            raise ValueError(f"StreamingLLM: budget={min(budgets)} must exceed the n_sink={self.n_sink} sinks")
        room = 1 if self.decode else 0  # the decode write needs a free slot
        counts = [min(t, c - room) for c, t in zip(budgets, lengths)]
        return req.finish(
            [counts] * num_layers,
            decode_budget=budgets if self.decode else (),
            capacity=max(budgets) + req.question_tokens if self.decode else max(counts) + req.max_new_tokens,
            evicts=any(c < t for c, t in zip(counts, lengths)),
        )

    def _keep(self, cache: KVCache, counts: jax.Array) -> jax.Array:
        sinks = cache.valid & (cache.pos < self.n_sink)
        return select(cache.pos.astype(jnp.float32), cache.valid, counts, pos=cache.pos, protected=sinks)

    def prefill_keep(self, plan: Plan, cache: KVCache, obs: Observations) -> tuple[jax.Array, None]:
        return self._keep(cache, as_i32(plan.counts)[..., None]), None

    def decode_update(
        self, plan: Plan, state: DecodeState, cache: KVCache, step_probs: jax.Array, written: jax.Array, t: jax.Array
    ) -> tuple[DecodeState, jax.Array]:
        if not self.decode:
            return state, cache.valid
        limit = as_i32(plan.decode_budget)[None, :, None] - 1
        over = jnp.any(cache.valid.sum(-1) > limit)
        return state, jax.lax.cond(over, lambda: self._keep(cache, limit), lambda: cache.valid)
