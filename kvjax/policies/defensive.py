"""DefensiveKV and Layer-DefensiveKV: defensive (worst-case) aggregation of window attention
(arXiv 2510.13334, code FFY0/DefensiveKV `efficient_defensivekv_press.py`).

Per (layer, row), with the last w prompt queries and A the softmax over all keys (window
included) restricted to the T - w non-window keys, per query head g and window query i:
  1. each row A[g, i, :] is avg-pooled (kernel k, zero padding, / k) and rescaled to its own
     pre-pooling mass;
  2. defensive aggregation: s_j = max over the group's heads and the window queries of the pooled
     A, floored at the head's mean over keys, s_j = max(max_{g,i} A'[g,i,j], mean_j' max_{g,i} A'[g,i,j']);
  3. CriticalKV weighting: s_j *= n_h(j) / sum_h' n_h'(j), with n_h(j) the group mean of
     ||v_j W_o^g||_1 (the `output_norms` observation), normalised across the KV heads as in the code;
  4. stage 1 keeps, per head, the fewest keys (by the window-and-group mean attention) whose
     normalised mass reaches 0.9 - bias, at most n_kept - w of them, where bias is the mean attention
     mass on the last w non-window keys (the code's `window_bias`: it slices after dropping the
     window, so it measures those keys, not the window; computed per row here, the code's batch is 1);
  5. the window and the stage-1 keys are kept; the rest of the layer's budget goes to the best s
     across all KV heads of the layer (DefensiveKV, Ada-KV-style head budgets, no floor) or across
     all layers and heads (Layer-DefensiveKV).
Budget: the layer keeps int(T (1 - r) Hkv) entries for a ratio (the code's rounding) or Hkv * C for
a budget C per head; Layer-DefensiveKV keeps int(T (1 - r) Hkv L) (or Hkv L C) over all layers.
[kvjax choice] Layer-DefensiveKV protects every layer's window (in the code a layer whose best
score falls below the global threshold could lose its window and keep nothing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.kernels import masked_softmax
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.allocators import Allocator, Global
from kvjax.policies.base import (
    Plan,
    Requirements,
    as_i32,
    check_int,
    check_pool_kernel,
    select,
    window_protected,
)
from kvjax.policies.critical import require_output_norms
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored, attention_scale, last_window, pool1d

STAGE1_MASS = 0.9  # cumulative attention mass of the stage-1 keys (the code's threshold)


def defensive_statistics(
    q: jax.Array, qpos: jax.Array, cache: KVCache, lengths: jax.Array, window: int, kernel: int, scale: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per layer: (s [L,B,Hkv,C] defensive aggregate, ave [L,B,Hkv,C] mean attention over window and
    group, bias [L,B] mass on the last w non-window keys, cand [L,B,Hkv,C] non-window slots).

    q [L,B,Hq,w,D] window queries, qpos [B,w]. One layer at a time ([B,Hq,w,C] probabilities).
    """
    w = window
    Hkv = cache.k.shape[2]

    def one(xs):
        ql, kl, pl, vl = xs
        B, Hq, _, D = ql.shape
        G = Hq // Hkv
        logits = jnp.einsum("bhgwd,bhcd->bhgwc", ql.reshape(B, Hkv, G, w, D), kl,
                            preferred_element_type=jnp.float32) * scale
        see = vl[:, :, None, None, :] & (pl[:, :, None, None, :] <= qpos[:, None, None, :, None])
        see = see & (qpos >= 0)[:, None, None, :, None]
        cand = vl & (pl < (lengths - w)[:, None, None])
        a = jnp.where(cand[:, :, None, None], masked_softmax(logits, see), 0.0)
        ave = a.mean((2, 3))
        base = a.sum(-1, keepdims=True)
        pooled = jnp.where(cand[:, :, None, None], pool1d(a, cand[:, :, None, None], kernel, "avg"), 0.0)
        tot = pooled.sum(-1, keepdims=True)
        pooled = pooled / jnp.where(tot > 0, tot, 1.0) * base
        mx = pooled.max((2, 3))
        n = jnp.maximum(cand.sum(-1, keepdims=True), 1)
        floor = jnp.where(cand, mx, 0.0).sum(-1, keepdims=True) / n
        s = jnp.where(cand, jnp.maximum(mx, floor), 0.0)
        tail = cand & (pl >= (lengths - 2 * w)[:, None, None])
        bias = jnp.where(tail[:, :, None, None], a, 0.0).sum(-1).mean((1, 2, 3))
        return s, ave, bias, cand

    return jax.lax.map(one, (q, cache.k, cache.pos, cache.valid))


def stage_one(ave: jax.Array, cand: jax.Array, pos: jax.Array, threshold: jax.Array, cap: jax.Array) -> jax.Array:
    """Per head, the fewest keys by `ave` whose normalised mass reaches `threshold` [L,B] (at most
    `cap` [L,B]): the count is the first index where the sorted cumulative mass >= threshold (0 if
    never, as torch.argmax of an all-False mask). Returns the stage-1 mask [L,B,Hkv,C]."""
    a = jnp.where(cand, ave, 0.0)
    tot = a.sum(-1, keepdims=True)
    norm = a / jnp.where(tot > 0, tot, 1.0)
    srt = -jnp.sort(-jnp.where(cand, norm, -jnp.inf), axis=-1)
    csum = jnp.cumsum(jnp.where(jnp.isfinite(srt), srt, 0.0), axis=-1)
    reached = (csum >= threshold[:, :, None, None]) & jnp.isfinite(srt)
    count = jnp.argmax(reached, axis=-1).astype(jnp.int32)
    count = jnp.clip(count, 0, jnp.maximum(cap, 0)[:, :, None])
    return select(a, cand, count, pos=pos)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DefensiveKV(PrefillPolicy):
    """DefensiveKV with the authors' defaults: window 32, avg-pool kernel 5, head-adaptive budgets.

    layer_wise=True is Layer-DefensiveKV (one budget over all layers and heads). A budget C (per
    KV head, window included, the average over heads and layers) must exceed the window; a ratio r
    follows the code's int(T (1 - r) Hkv) per layer. Prompts must be longer than the window.
    The allocation is `Global(across_layers=layer_wise)`; `allocator` is unused.
    """

    name = "defensivekv"
    chunked_prefill_reason = "its output-norm weights (v W_o per key) are recorded by the one-shot prefill only"

    window: int = 32
    kernel: int = 5
    layer_wise: bool = False

    def __post_init__(self) -> None:
        check_int("window", self.window, 1)
        check_pool_kernel("kernel", self.kernel)
        if not isinstance(self.layer_wise, bool):
            raise TypeError(f"layer_wise must be a bool, got {self.layer_wise!r}")
        super().__post_init__()

    def budget_allocator(self) -> Allocator:
        return Global(across_layers=self.layer_wise)

    def protected_count(self) -> int:
        return self.window

    def scorer_requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(window=self.window, output_norms=True))

    def check_lengths(self, lengths: tuple[int, ...]) -> None:
        if min(lengths) <= self.window:
            raise ValueError(f"{type(self).__name__} needs every prompt longer than window={self.window} "
                             f"(the authors' code asserts T > w); the shortest has {min(lengths)} tokens")

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        """Scores s of the non-window slots; protected = window + stage-1 slots."""
        w = self.window
        lengths = as_i32(plan.lengths)
        q, qpos = last_window(obs, w)
        scale = attention_scale(obs, cache.k.shape[-1], False)
        s, ave, bias, cand = defensive_statistics(q, qpos, cache, lengths, w, self.kernel, scale)
        norms = jnp.where(cand, require_output_norms(obs, "DefensiveKV"), 0.0)
        share = norms / jnp.maximum(norms.sum(2, keepdims=True), jnp.finfo(jnp.float32).tiny)
        s = s * share
        cap = as_i32(plan.counts) - w
        first = stage_one(ave, cand, cache.pos, STAGE1_MASS - bias, cap)
        prot = window_protected(cache.pos, cache.valid, lengths, w) | first
        return Scored(jnp.where(cand, s, 0.0), prot)
