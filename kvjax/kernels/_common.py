"""Shared pieces of the kernel dispatchers: implementation choice, argument checks, block maths."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.kernels._dispatch import ENV_VAR, IMPLEMENTATIONS, resolve_implementation  # noqa: F401
from kvjax.kernels.reductions import (  # noqa: F401
    ENTROPY_EPS,
    GROUP_REDUCTIONS,
    MOMENTS,
    combine_group_rows,
    group_reduce_rows,
    moment_contribution,
)

# Finite "minus infinity" for masked logits inside kernels: exp(MASK - m) underflows to 0
# without producing inf - inf = NaN (same constant as jax's TPU flash attention).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
INT_BIG = int(np.iinfo(np.int32).max)


def check_scale(scale: Any) -> float:
    """The softmax scale must be a concrete number (it is baked into the kernels)."""
    if isinstance(scale, bool):
        raise TypeError(f"scale must be a positive float, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(f"scale must be a concrete Python float (not a traced value), got {scale!r}") from err
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite float, got {value}")
    return value


def check_array(name: str, x: Any, ndim: int, kind: str) -> None:
    """Check rank and dtype family ("float", "int" or "bool") of an argument."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(x.shape)}")
    ok = {
        "float": jnp.issubdtype(x.dtype, jnp.floating),
        "int": jnp.issubdtype(x.dtype, jnp.integer),
        "bool": x.dtype == jnp.bool_,
    }[kind]
    if not ok:
        accepted = {"float": "a floating dtype", "int": "an integer dtype (int32)", "bool": "bool"}[kind]
        raise TypeError(f"{name} must have {accepted}, got dtype {x.dtype}")


def check_dims(name: str, shape: tuple[int, ...], expected: tuple[int, ...], layout: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(shape)}")


def check_qk(queries: Any, keys: Any, q_name: str = "queries") -> tuple[int, int, int, int]:
    """Checks a [B,Hq,T,D] / [B,Hkv,S,D] pair; returns (B, Hkv, G, D)."""
    check_array(q_name, queries, 4, "float")
    check_array("keys", keys, 4, "float")
    b, hq, _, d = queries.shape
    bk, hkv, _, dk = keys.shape
    if bk != b or dk != d:
        raise ValueError(
            f"{q_name} {tuple(queries.shape)} and keys {tuple(keys.shape)} must agree on batch and head_dim"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv}) for GQA")
    return b, hkv, hq // hkv, d


def common_dtype(*xs: Any) -> Any:
    return jnp.result_type(*[x.dtype for x in xs])


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pick_block(n: int, target: int, align: int) -> int:
    """Largest multiple of ``align`` that divides ``n`` (a multiple of align) and is <= target."""
    b = max(align, min(target, n) // align * align)
    while n % b:
        b -= align
    return b


def pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    """Pads ``axis`` at the end up to ``size`` (no copy when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def block_visibility(qpos: jax.Array, kpos: jax.Array, bq: int, bk: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Which (query block, key block) pairs hold any visible (query, key) pair.

    qpos [B,Tp] (-1 = padding), kpos [B,Hkv,Sp] (-1 = empty); Tp, Sp multiples of the blocks.
    Returns run [B,Hkv,nQ,nK] bool, qmax [B,nQ] (largest query position, -1 if none) and kmin
    [B,Hkv,nK] (smallest valid key position, INT32_MAX if none). A pair with kmin > qmax holds
    no visible pair, so it can be skipped whatever the order of the positions.
    """
    b, tp = qpos.shape
    _, hkv, sp = kpos.shape
    qmax = jnp.max(qpos.reshape(b, tp // bq, bq), axis=-1).astype(jnp.int32)
    kmin = jnp.min(jnp.where(kpos >= 0, kpos, INT_BIG).reshape(b, hkv, sp // bk, bk), axis=-1).astype(jnp.int32)
    return kmin[:, :, None, :] <= qmax[:, None, :, None], qmax, kmin


def key_block_ranges(qpos: jax.Array, kpos: jax.Array, bq: int, bk: int, window: int | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The key blocks each query block must visit, for loops that skip the rest (the causal upper
    triangle of a prefill); exact for any positions, since a skipped block holds no visible pair.

    qpos [B,Tp] (-1 = padding), kpos [B,Hkv,Sp] (-1 = empty), Tp and Sp multiples of bq and bk. Query
    i sees key j iff 0 <= kpos[j] <= qpos[i] (and kpos[j] > qpos[i] - window when given).
    Returns, over the batch and heads together: start, end [nQ] int32, the range of key blocks that
    may hold a visible pair (start = end = 0 when none), and full [nQ,nK] bool, the block pairs in
    which every query sees every key (no mask needed there).
    """
    b, tp = qpos.shape
    _, hkv, sp = kpos.shape
    qb = qpos.reshape(b, tp // bq, bq)
    kb = kpos.reshape(b, hkv, sp // bk, bk)
    qmax = jnp.max(qb, axis=-1)[:, None, :, None]  # [B,1,nQ,1]
    qmin = jnp.min(jnp.where(qb >= 0, qb, INT_BIG), axis=-1)[:, None, :, None]
    qall = jnp.all(qb >= 0, axis=-1)[:, None, :, None]
    kmin = jnp.min(jnp.where(kb >= 0, kb, INT_BIG), axis=-1)[:, :, None, :]  # [B,Hkv,1,nK]
    kmax = jnp.max(kb, axis=-1)[:, :, None, :]
    kall = jnp.all(kb >= 0, axis=-1)[:, :, None, :]
    some = kmin <= qmax
    every = qall & kall & (kmax <= qmin)
    if window is not None:
        some &= kmax > qmin - window
        every &= kmin > qmax - window
    some = jnp.any(some, axis=(0, 1))  # [nQ,nK]
    every = jnp.all(every, axis=(0, 1))
    idx = jnp.arange(some.shape[1], dtype=jnp.int32)
    end = jnp.max(jnp.where(some, idx + 1, 0), axis=1).astype(jnp.int32)
    start = jnp.min(jnp.where(some, idx, INT_BIG), axis=1)
    start = jnp.where(end > 0, start, 0).astype(jnp.int32)
    return start, end, every


def last_visible_block(run: jax.Array) -> jax.Array:
    """[B,Hkv,nQ]: last key block each query block must visit (0 when none)."""
    idx = jnp.arange(run.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(run, idx, 0), axis=-1).astype(jnp.int32)


def first_visible_block(run: jax.Array) -> jax.Array:
    """[B,Hkv,nK]: first query block that sees each key block (nQ-1 when none)."""
    nq = run.shape[2]
    idx = jnp.arange(nq, dtype=jnp.int32)[:, None]
    first = jnp.min(jnp.where(run, idx, nq), axis=2)
    return jnp.where(first == nq, nq - 1, first).astype(jnp.int32)


def check_moments(moments: Any) -> tuple[str, ...]:
    if isinstance(moments, str):
        moments = (moments,)
    moments = tuple(moments)
    if not moments or any(m not in MOMENTS for m in moments) or len(set(moments)) != len(moments):
        raise ValueError(f"moments must be a non-empty tuple of distinct names from {MOMENTS}, got {moments!r}")
    return moments


def check_group_reduce(group_reduce: Any) -> str | None:
    if group_reduce not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCTIONS}, got {group_reduce!r}")
    return group_reduce


def grouped_logits(queries: jax.Array, keys: jax.Array, query_positions: jax.Array, key_positions: jax.Array,
                   *, scale: float) -> tuple[jax.Array, jax.Array]:
    """float32 logits [B,Hkv,G,T,S] of queries [B,Hq,T,D] on keys [B,Hkv,S,D] (GQA by reshaping the
    queries), and the causal mask of the same shape: 0 <= key_positions[s] <= query_positions[t]."""
    b, hq, t, d = queries.shape
    hkv = keys.shape[1]
    q = queries.reshape(b, hkv, hq // hkv, t, d)
    logits = jnp.einsum("bhgtd,bhsd->bhgts", q, keys, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    kpos = key_positions[:, :, None, None, :]
    return logits, (kpos >= 0) & (kpos <= query_positions[:, None, None, :, None])


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis where `mask`; a fully masked row gives zeros, never NaN
    (masked logits are dropped before any arithmetic, so NaN there cannot leak)."""
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(logits - m), 0.0)
    s = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(s > 0, s, 1.0)
