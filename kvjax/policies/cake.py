"""CAKE: layer budgets from attention dispersion and shift, mean + gamma*variance indicator (policies.md §8).

Shapes: L layers, B rows, Hkv KV heads, C slots; the decode state is `CakeState` (limit [L,B]).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.allocators import (
    Allocation,
    Allocator,
    Cake,
    cake_log_preference,
    cake_statistics,
)
from kvjax.policies.base import (
    DecodeState,
    Plan,
    PlanRequest,
    Requirements,
    as_i32,
    check_bool,
    check_float,
    check_int,
    select,
    window_protected,
)
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored, attention_scale, pool1d

# (tau1, tau2) from cakekv's experiments/LongBench/config/model2tau.json, by cache size 1024 / 128.
CAKE_TAUS = {
    "llama3.1-8b-128k": {1024: (1.6, 0.4), 128: (1.6, 0.6)},
    "llama2-7b-chat-4k": {1024: (1.9, 1.8), 128: (0.9, 2.3)},
    "llama2-13b-chat-4k": {1024: (0.5, 0.4), 128: (1.8, 2.0)},
    "mistral-0.3-7b-32k": {1024: (0.8, 0.5), 128: (1.0, 0.8)},
    "qwen2.5-7b-instruct": {1024: (1.5, 0.6), 128: (0.4, 0.6)},
}

POOL_KERNEL = 5  # avg-pool kernel, hard-coded in cakekv


@struct.dataclass
class CakeState(DecodeState):
    """CAKE's decode state. limit: [L,B] int32 entries a head of (layer, row) keeps after each
    decode-time eviction (hh_l + w)."""

    limit: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class CAKE(PrefillPolicy):
    """CAKE with the original defaults: C = budget (window included), w=32, gamma=200, avg-pool 5.

    Prefill: per layer the preference P_l = H_l^(1/tau1) V_l^(1/tau2) (entropy and summed
    unbiased variance of the window attention on non-window keys, per row) splits (C - w)*L
    across layers (`Cake` allocator); each layer keeps its top b_l by the indicator
    mean_i A + gamma * var_i A (avg-pooled, then group mean) plus the window. `allocator=None`
    uses Cake(tau1, tau2, window, cap_factor, parity); any other allocator may replace it.
    Decode (decode=True): a layer holding more than hh_l + w entries keeps the w newest and the
    top hh_l by the step's probabilities (group mean, avg-pooled in position order).
    `tau1`/`tau2` default to 1 (the code's fallback); `CAKE.for_model` reads the authors' table.
    cascade=True replays cakekv's cascading prefill (budgets recomputed after every layer over the
    layers seen so far, earlier layers re-evicted from their stored indicators; see `Cake`).
    """

    name = "cake"
    chunked_prefill_reason = None

    window: int = 32
    gamma: float = 200.0
    tau1: float = 1.0
    tau2: float = 1.0
    cap_factor: int = 2
    parity: bool = False
    cascade: bool = False
    decode: bool = True
    use_model_scale: bool = True
    allocator: Allocator | None = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_int("window", self.window, 2)
        check_float("gamma", self.gamma, 0.0, math.inf, hi_open=True)
        check_bool("decode", self.decode)
        check_bool("use_model_scale", self.use_model_scale)
        super().__post_init__()  # builds budget_allocator(), which validates tau1, tau2, cap_factor, parity

    @classmethod
    def for_model(cls, model: str, cache_size: int, **overrides: Any) -> "CAKE":
        """CAKE with the authors' (tau1, tau2) for `model` at cache size 1024 or 128 (else 1, 1)."""
        if model not in CAKE_TAUS:
            raise ValueError(f"model must be one of {tuple(CAKE_TAUS)}, got {model!r}")
        tau1, tau2 = CAKE_TAUS[model].get(cache_size, (1.0, 1.0))
        return cls(tau1=tau1, tau2=tau2, **overrides)

    def budget_allocator(self) -> Allocator:
        if self.allocator is not None:
            return self.allocator
        return Cake(tau1=self.tau1, tau2=self.tau2, window=self.window, cap_factor=self.cap_factor, parity=self.parity,
                    cascade=self.cascade)

    def protected_count(self) -> int:
        return self.window

    def scorer_requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(window=self.window, step_probs=self.decode),
                            decode_eviction=self.decode)

    def finish_plan(self, req: PlanRequest, alloc: Allocation) -> Plan:
        """Decode: capacity hh_l + w + 1; decode_budget = C for rows left whole, -1 for the
        compressed ones (their limit is what prefill kept, read from the cache in init_decode)."""
        if not self.decode:
            return super().finish_plan(req, alloc)
        decode_budget, peak = [], 0
        layers = range(req.num_layers)
        for b, (t, c) in enumerate(zip(req.lengths, req.row_budgets(self.kvpress_compat))):
            if any(alloc.compressed[l][b] for l in layers):
                decode_budget.append(-1)
                peak = max(peak, max(alloc.bound[l][b] for l in layers))
            else:
                decode_budget.append(c)
                peak = max(peak, t, c)
        return req.finish(
            alloc.counts,
            alloc=alloc.data,
            decode_budget=decode_budget,
            capacity=peak + 1 + req.question_tokens,
            evicts=alloc.evicts,
        )

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        lengths = as_i32(plan.lengths)
        scale = attention_scale(obs, cache.k.shape[-1], self.use_model_scale)
        ent, var_sum, mean, var, cand = cake_statistics(obs, cache, lengths, self.window, scale)
        ind = pool1d(mean + self.gamma * var, cand[:, :, :, None], POOL_KERNEL, "avg").mean(3)
        log_pref = None
        alloc = self.budget_allocator()
        if isinstance(alloc, Cake) and alloc.window == self.window:
            log_pref = cake_log_preference(ent, var_sum, alloc.tau1, alloc.tau2)
        prot = window_protected(cache.pos, cache.valid, lengths, self.window)
        return Scored(jnp.where(cand, ind, 0.0), prot, layer_log_pref=log_pref)

    def init_decode(self, plan: Plan, cache: KVCache, slot_state: DecodeState | None) -> DecodeState:
        """hh_l + w per (layer, row): the entries kept after prefill, or C where nothing was evicted."""
        if not self.decode:
            return DecodeState()
        fixed = as_i32(plan.decode_budget)[None, :]
        kept = cache.valid.sum(-1)[:, :, 0].astype(jnp.int32)
        return CakeState(limit=jnp.where(fixed >= 0, fixed, kept))

    def decode_update(
        self, plan: Plan, state: DecodeState, cache: KVCache, step_probs: jax.Array, written: jax.Array, t: jax.Array
    ) -> tuple[DecodeState, jax.Array]:
        if not self.decode:
            return state, cache.valid
        limit = state.limit[..., None]  # [L,B,1]
        valid, pos, w = cache.valid, cache.pos, self.window
        over = jnp.any(valid.sum(-1) > limit)

        def evict() -> jax.Array:
            n = valid.sum(-1, keepdims=True)
            big = jnp.iinfo(jnp.int32).max
            iota = jax.lax.broadcasted_iota(jnp.int32, valid.shape, 3)
            perm = jax.lax.sort((jnp.where(valid, pos, big), iota), dimension=-1, num_keys=1)[1]
            asc = jax.lax.sort((perm, iota), dimension=-1, num_keys=1)[1]  # rank by position
            p = jnp.take_along_axis(step_probs.astype(jnp.float32).mean(3), perm, -1)
            pooled = pool1d(p, iota < n - w, POOL_KERNEL, "avg")
            score = jnp.take_along_axis(pooled, asc, -1)
            recent = valid & (asc >= n - w)
            return select(score, valid, limit, pos=pos, protected=recent)

        return state, jax.lax.cond(over, evict, lambda: valid)
