"""Shared scoring helpers: observation-window attention, pooling, GQA reduction (policies.md §1.7-1.9).

All scores are float32. Prefill scorers rely on the engine fact that, right after prefill,
slot i of row b holds position i (right padding), so pooling along slots is pooling along
positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.kernels import window_scores
from kvjax.kernels.reductions import group_reduce_rows
from kvjax.observations import Observations
from kvjax.policies.base import check_choice

POOLINGS = ("max", "avg", "none")
GQA_REDUCES = ("mean", "max", "sum")


def group_reduce_fn(x: jax.Array, how: str, axis: int) -> jax.Array:
    check_choice("gqa_reduce", how, GQA_REDUCES)
    return group_reduce_rows(x, how, axis)


def attention_scale(obs: Observations, head_dim: int, use_model_scale: bool) -> float:
    """The model's attention scale when the observations carry one (`attn_scale`, set by the
    model's `extend`) and `use_model_scale`, else 1/sqrt(d) (kvpress's scorers always use 1/sqrt(d)).

    Llama-family models score with 1/sqrt(head_dim), so there the switch changes nothing; it
    matters for a model whose softmax scale differs (e.g. a query_pre_attn_scalar)."""
    scale = getattr(obs, "attn_scale", None) if use_model_scale else None
    return float(scale) if scale is not None else head_dim**-0.5


def window_moments(
    queries: jax.Array,
    query_positions: jax.Array,
    cache: KVCache,
    *,
    scale: float,
    group_reduce: str | None,
    moments: Sequence[str],
) -> dict[str, jax.Array]:
    """Window attention moments for every layer.

    queries [L,B,Hq,w,D]; query_positions [B,w]; cache.k [L,B,Hkv,S,D], cache.pos [L,B,Hkv,S].
    Returns float32 [L,B,Hkv,S] per moment (or [L,B,Hkv,G,S] when group_reduce is None).
    Layers are folded into the batch so that the kernel runs once.
    """
    L, B, Hq, w, D = queries.shape
    Hkv, S = cache.k.shape[2], cache.k.shape[3]
    qpos = jnp.broadcast_to(query_positions[None], (L, B, w)).reshape(L * B, w)
    out = window_scores(
        queries.reshape(L * B, Hq, w, D),
        cache.k.reshape(L * B, Hkv, S, D),
        qpos.astype(jnp.int32),
        cache.pos.reshape(L * B, Hkv, S).astype(jnp.int32),
        scale=scale,
        group_reduce=group_reduce,
        moments=tuple(moments),
    )
    return {k: v.astype(jnp.float32).reshape((L, B) + v.shape[1:]) for k, v in out.items()}


def last_window(obs: Observations, w: int) -> tuple[jax.Array, jax.Array]:
    """The last `w` window queries [L,B,Hq,w,D] and their positions [B,w] from the observations."""
    q, p = obs.window_queries, obs.window_positions
    if q.shape[3] < w:
        raise ValueError(f"observations hold a window of {q.shape[3]} queries; this policy needs {w}")
    return q[:, :, :, q.shape[3] - w :, :], p[:, p.shape[1] - w :]


def pool1d(x: jax.Array, region: jax.Array, kernel: int, kind: str, offset: int = 0) -> jax.Array:
    """Stride-1 'same' pooling along the last axis over the slots in `region` (policies.md §1.8).

    Slot j pools slots j - kernel//2 - offset .. j + kernel//2 - offset: offset 0 is centred; a positive
    offset (at most kernel//2) moves the window back, so a high slot lends its value to more of the slots
    after it than before. Slots outside `region` act as padding: zeros for "avg" (every output divided by
    `kernel`, as PyTorch's count_include_pad) and -inf for "max". The region must be contiguous.
    """
    check_choice("pooling", kind, POOLINGS)
    if not 0 <= offset <= kernel // 2:
        raise ValueError(f"pool1d: offset must be in [0, kernel // 2 = {kernel // 2}], got {offset}")
    if kind == "none" or kernel <= 1:
        return jnp.where(region, x, 0)
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel // 2 + offset, kernel // 2 - offset)]
    dims = (1,) * (x.ndim - 1) + (kernel,)
    strides = (1,) * x.ndim
    if kind == "avg":
        s = jax.lax.reduce_window(jnp.where(region, x, 0.0), 0.0, jax.lax.add, dims, strides, pad)
        return s / kernel
    return jax.lax.reduce_window(jnp.where(region, x, -jnp.inf), -jnp.inf, jax.lax.max, dims, strides, pad)


def _window_max(x: jax.Array, before: int, after: int) -> jax.Array:
    """Max along the last axis over slots j - before .. j + after (-inf beyond the ends)."""
    dims, strides = (1,) * (x.ndim - 1) + (before + after + 1,), (1,) * x.ndim
    pad = [(0, 0)] * (x.ndim - 1) + [(before, after)]
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, strides, pad)


def bridge1d(x: jax.Array, region: jax.Array, reach: int) -> jax.Array:
    """Fills valleys between high slots along the last axis: slot j takes max(x_j, min(max x over
    j-reach .. j, max x over j .. j+reach)), over the slots in `region` (others are padding and left as
    they are). A run of low slots flanked within `reach` on both sides by higher ones rises to the lower
    flank; a lone peak does not spread (unlike max pooling). reach 0: x unchanged. The region must be
    contiguous.
    """
    if reach < 0:
        raise ValueError(f"bridge1d: reach must be >= 0, got {reach}")
    if reach == 0:
        return x
    xm = jnp.where(region, x, -jnp.inf)
    filled = jnp.minimum(_window_max(xm, reach, 0), _window_max(xm, 0, reach))
    return jnp.where(region, jnp.maximum(x, filled), x)


def trail1d(x: jax.Array, region: jax.Array, reach: int) -> jax.Array:
    """The max of the `reach` slots before each slot along the last axis, over the slots in `region`
    (-inf where none is in it): what a value's tail inherits from the slots that start it. [..., C]."""
    if reach < 1:
        raise ValueError(f"trail1d: reach must be >= 1, got {reach}")
    w = _window_max(jnp.where(region, x, -jnp.inf), reach - 1, 0)  # slots j-reach+1 .. j, then shifted by one
    return jnp.concatenate([jnp.full(x.shape[:-1] + (1,), -jnp.inf, w.dtype), w[..., :-1]], axis=-1)


class Scored(NamedTuple):
    """A prefill scorer's output.

    scores: float32 [L,B,Hkv,C], higher = keep (only candidate slots matter).
    protected: bool [L,B,Hkv,C], slots kept first (window, sinks).
    layer_log_pref: float32 [L,B], CAKE's layer preference log P_l when the scorer computed it with
      the `Cake` allocator's window and taus (so the allocator reuses it), else None.
    """

    scores: jax.Array
    protected: jax.Array
    layer_log_pref: jax.Array | None = None
