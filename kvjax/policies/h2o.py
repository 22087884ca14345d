"""H2O: heavy hitters by accumulated attention plus a recent window (policies.md §3).

Shapes: L layers, B rows, Hkv KV heads, C slots; the decode state is `H2OState` (acc [L,B,Hkv,C]).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.base import (
    DecodeState,
    Plan,
    PlanRequest,
    Policy,
    Requirements,
    as_i32,
    check_bool,
    check_int,
    recent_mask,
    select,
    window_protected,
)
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored


@struct.dataclass
class H2OState(DecodeState):
    """H2O's per-slot state. acc: [L,B,Hkv,C] float32 attention mass accumulated by each cached
    entry (0 on free slots); prefill hands it over per slot, moved with the compaction."""

    acc: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2OPrefill(PrefillPolicy):
    """H2O's prefill scoring: the attention mass all causal prompt queries put on each key.

    Default (KVCache-Factory H2OKVCluster): raw column sums, summed over the query group, the last
    `window`=8 tokens protected, no compression if T < C. `observed_attention_kvpress`
    (kvpress ObservedAttentionPress): window=0, normalize=True, i.e. s_j = mass_j / (T - j),
    the mean over the queries that see j. Scores are group sums (kvpress: group means), which
    ranks identically.
    """

    name = "h2o_prefill"
    chunked_prefill_reason = None

    window: int = 8
    normalize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window", self.window, 0)
        check_bool("normalize", self.normalize)

    def protected_count(self) -> int:
        return self.window

    def scorer_requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(column_mass=True))

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        lengths = as_i32(plan.lengths)
        t = lengths[None, :, None, None]
        s = obs.column_mass.astype(jnp.float32)
        if self.normalize:
            s = s / jnp.maximum(t - cache.pos, 1).astype(jnp.float32)
        cand = cache.valid & (cache.pos < t - self.window)
        return Scored(jnp.where(cand, s, 0.0), window_protected(cache.pos, cache.valid, lengths, self.window))


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2O(Policy):
    """Decode-time H2O: budget = hh + recent entries per KV head.

    acc (float32, per slot) starts as the prefill column mass (group sum) and adds the group sum
    of every decode step's probabilities. Whenever a head holds more than `budget` entries
    (after prefill, and after each step's attention) it keeps its `recent` newest entries plus
    the top (budget - recent) by acc; ties evict the newer token. recent=None: budget // 2.
    Capacity budget + 1 (one free slot for the next write).
    """

    name = "h2o"
    chunked_prefill_reason = None

    recent: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent is not None:
            check_int("recent", self.recent, 0)

    def requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(column_mass=True, step_probs=True), decode_eviction=True)

    def build_plan(self, req: PlanRequest) -> Plan:
        lengths, num_layers = req.lengths, req.num_layers
        budgets = req.row_budgets(self.kvpress_compat)
        for b, c in enumerate(budgets):
            r = c // 2 if self.recent is None else self.recent
            if c <= r:
                raise ValueError(f"H2O: row {b} has budget {c}, which must exceed recent={r} (heavy hitters hh >= 1)")
        counts = [[min(c, t) for c, t in zip(budgets, lengths)]] * num_layers
        return req.finish(
            counts,
            decode_budget=budgets,
            capacity=max(budgets) + 1 + req.question_tokens,
            evicts=any(c < t for c, t in zip(budgets, lengths)),
        )

    def recent_counts(self, plan: Plan) -> jax.Array | int:
        """Newest entries each head keeps: `recent`, or half of each row's budget ([B])."""
        if self.recent is not None:
            return self.recent
        return as_i32(plan.decode_budget) // 2

    def _keep(self, plan: Plan, acc: jax.Array, cache: KVCache, counts: jax.Array) -> jax.Array:
        recent = recent_mask(cache.pos, cache.valid, jnp.reshape(self.recent_counts(plan), (1, -1, 1)))
        return select(acc, cache.valid, counts, pos=cache.pos, protected=recent)

    def prefill_keep(self, plan: Plan, cache: KVCache, obs: Observations) -> tuple[jax.Array, H2OState]:
        acc = jnp.where(cache.valid, obs.column_mass.astype(jnp.float32), 0.0)
        keep = self._keep(plan, acc, cache, as_i32(plan.counts)[..., None])
        return keep, H2OState(acc=acc)

    def init_decode(self, plan: Plan, cache: KVCache, slot_state: H2OState) -> H2OState:
        return H2OState(acc=jnp.where(cache.valid, slot_state.acc, 0.0))

    def decode_update(
        self, plan: Plan, state: H2OState, cache: KVCache, step_probs: jax.Array, written: jax.Array, t: jax.Array
    ) -> tuple[H2OState, jax.Array]:
        """acc += group sum of step_probs [L,B,Hkv,G,C]; evict down to budget where over it."""
        fresh = jnp.arange(cache.valid.shape[-1]) == written[..., None]
        acc = jnp.where(fresh, 0.0, state.acc) + step_probs.astype(jnp.float32).sum(3)
        acc = jnp.where(cache.valid, acc, 0.0)
        budget = as_i32(plan.decode_budget)[None, :, None]
        over = jnp.any(cache.valid.sum(-1) > budget)
        keep = jax.lax.cond(over, lambda: self._keep(plan, acc, cache, budget), lambda: cache.valid)
        return H2OState(acc=jnp.where(keep, acc, 0.0)), keep

