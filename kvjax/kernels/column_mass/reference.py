"""XLA reference for column mass: loops over query chunks, never holding the T x S softmax.

Each chunk recomputes p = exp(s - lse) for its queries against all keys and adds the column
sums (policies.md §3: "a chunked-query XLA reference that recomputes exp(s - lse) per query
block"). The production path on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.kernels import _common

_CHUNK_ELEMENTS = 1 << 24  # float32 elements of one chunk's logits (64 MiB)


def chunk_size(b: int, hq: int, t: int, s: int) -> int:
    """Power of two in [8, 512], smaller when the chunk's logits would be large."""
    c = 512
    while c > 8 and b * hq * c * s > _CHUNK_ELEMENTS:
        c //= 2
    return min(c, 1 << max(0, (t - 1).bit_length()))


def column_mass(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                key_positions: jax.Array, *, scale: float, lse: jax.Array | None = None,
                chunk: int | None = None) -> jax.Array:
    """queries [B,Hq,T,D], keys [B,Hkv,S,D] -> float32 [B,Hkv,S]; lse optional [B,Hq,T]."""
    b, hq, t, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    c = chunk or chunk_size(b, hq, t, s)
    tp = _common.round_up(t, c)
    n = tp // c
    q = _common.pad_axis(queries, 2, tp).reshape(b, hkv, g, n, c, d)
    qpos = _common.pad_axis(query_positions, 1, tp, -1).reshape(b, n, c)
    has_lse = lse is not None
    lse_c = (_common.pad_axis(lse.astype(jnp.float32), 2, tp) if has_lse
             else jnp.zeros((b, hq, tp), jnp.float32)).reshape(b, hkv, g, n, c)
    kpos = key_positions[:, :, None, None, :]

    def step(acc, xs):
        qc, qpc, lc = xs  # [B,Hkv,G,c,D], [B,c], [B,Hkv,G,c]
        logits = jnp.einsum("bhgcd,bhsd->bhgcs", qc, keys, precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * scale
        visible = (kpos >= 0) & (kpos <= qpc[:, None, None, :, None])
        if has_lse:
            row_lse = lc[..., None]
        else:
            masked = jnp.where(visible, logits, -jnp.inf)
            m = jnp.max(masked, axis=-1, keepdims=True)
            m = jnp.where(jnp.isfinite(m), m, 0.0)
            total = jnp.sum(jnp.where(visible, jnp.exp(masked - m), 0.0), axis=-1, keepdims=True)
            row_lse = m + jnp.log(jnp.where(total > 0, total, 1.0))
        p = jnp.where(visible, jnp.exp(logits - row_lse), 0.0)
        return acc + jnp.sum(p, axis=(2, 3)), None

    xs = (jnp.moveaxis(q, 3, 0), jnp.moveaxis(qpos, 1, 0), jnp.moveaxis(lse_c, 3, 0))
    acc, _ = lax.scan(step, jnp.zeros((b, hkv, s), jnp.float32), xs)
    return acc


def log_sum_exp(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                key_positions: jax.Array, *, scale: float) -> jax.Array:
    """[B,Hq,T] float32 log-sum-exp of each query's visible logits (0 for a query that sees none).

    What a flash pass would hand to ``column_mass``; materialises [B,Hq,T,S] (tests, small sizes).
    """
    b, hq, t, _ = queries.shape
    logits, visible = _common.grouped_logits(queries, keys, query_positions, key_positions, scale=scale)
    masked = jnp.where(visible, logits, -jnp.inf)
    lse = jax.nn.logsumexp(masked, axis=-1)
    return jnp.where(jnp.isfinite(lse), lse, 0.0).reshape(b, hq, t)
