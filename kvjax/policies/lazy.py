"""LazyEviction: recurrence-interval tracking with lagged eviction every W steps (policies.md §10).

Shapes: L layers, B rows, Hkv KV heads, C slots; the decode state is `LazyState` (ts, mri [L,B,Hkv,C]).
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
    check_float,
    check_int,
    recent_mask,
    select,
)

EPS = 1e-5


@struct.dataclass
class LazyState(DecodeState):
    """LazyEviction's per-slot state, [L,B,Hkv,C] int32. ts: the step of the entry's last activation
    (its write step - 1 until then); mri: its largest recurrence interval so far (0 until re-activated)."""

    ts: jax.Array
    mri: jax.Array


def lazy_priority(t: jax.Array, ts: jax.Array, mri: jax.Array) -> jax.Array:
    """The authors' code: I = 2σ(-(1 + Δ/(MRI + ε))) + [MRI > 0]·2σ(-(MRI - 1)), Δ = t - TS; float32."""
    delta = (t - ts).astype(jnp.float32)
    m = mri.astype(jnp.float32)
    h1 = 2.0 * jax.nn.sigmoid(-(1.0 + delta / (m + EPS)))
    h2 = jnp.where(mri == 0, 0.0, 2.0 * jax.nn.sigmoid(-(m - 1.0)))
    return h1 + h2


@dataclasses.dataclass(frozen=True, kw_only=True)
class LazyEviction(Policy):
    """Per slot TS (last activation step) and MRI (largest recurrence interval), int32.

    Each decode step t: the written slot gets TS = t - 1, MRI = 0; a slot is activated when any
    query head of its group gives it probability >= alpha (GQA-native); activated slots get
    MRI = max(MRI, t - TS), TS = t. When t % window == 0 and a head holds more than `budget`
    entries, it keeps its `window` newest entries and the top (budget - window) others by
    `lazy_priority` (ties: larger TS, then smaller position). Nothing is evicted at prefill or
    between those steps, so capacity = max(T, budget) + window.
    Defaults: window=175, alpha=1e-4 (the authors' eval_qwen.sh, DeepSeek-R1-Distill-Qwen-7B on
    MATH-500; its budget was 1492). Other script values of W: 101 (GSM8K), 363 (AIME).
    """

    name = "lazy_eviction"
    chunked_prefill_reason = "it evicts nothing at prefill (it holds the whole prompt until decoding)"

    window: int = 175
    alpha: float = 1e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window", self.window, 1)
        check_float("alpha", self.alpha, 0.0, 1.0, lo_open=True)

    def requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(step_probs=True), decode_eviction=True)

    def build_plan(self, req: PlanRequest) -> Plan:
        lengths, num_layers = req.lengths, req.num_layers
        budgets = req.row_budgets(self.kvpress_compat)
        if min(budgets) < self.window:
            raise ValueError(
                f"LazyEviction: budget={min(budgets)} is smaller than the window={self.window} "
                "recent tokens it protects"
            )
        return req.finish(
            [list(lengths)] * num_layers,
            decode_budget=budgets,
            capacity=max(max(lengths), max(budgets)) + self.window + req.question_tokens,
            evicts=False,
        )

    def prefill_keep(self, plan: Plan, cache: KVCache, obs: Observations) -> tuple[jax.Array, None]:
        return cache.valid, None

    def init_decode(self, plan: Plan, cache: KVCache, slot_state: None) -> LazyState:
        zeros = jnp.zeros(cache.valid.shape, jnp.int32)
        return LazyState(ts=zeros, mri=zeros)

    def decode_update(
        self, plan: Plan, state: LazyState, cache: KVCache, step_probs: jax.Array, written: jax.Array, t: jax.Array
    ) -> tuple[LazyState, jax.Array]:
        t = jnp.asarray(t, jnp.int32)
        fresh = jnp.arange(cache.valid.shape[-1]) == written[..., None]
        ts = jnp.where(fresh, t - 1, state.ts)
        mri = jnp.where(fresh, 0, state.mri)
        act = cache.valid & (step_probs.max(3) >= self.alpha)
        ts_new = jnp.where(act, t, ts)
        mri = jnp.maximum(mri, ts_new - ts)
        ts = ts_new
        budget = as_i32(plan.decode_budget)[None, :, None]

        def evict() -> jax.Array:
            recent = recent_mask(cache.pos, cache.valid, self.window)
            score = lazy_priority(t, ts, mri)
            return select(score, cache.valid, budget, pos=cache.pos, protected=recent, tiebreak=ts)

        due = (t % self.window == 0) & jnp.any(cache.valid.sum(-1) > budget)
        keep = jax.lax.cond(due, evict, lambda: cache.valid)
        return LazyState(ts=ts, mri=mri), keep
