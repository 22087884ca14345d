"""XLA reference for column mass: query chunks against key blocks, never holding the T x S softmax.

Each query chunk visits only the key blocks that can hold a visible key (`_common.key_block_ranges`:
a prefill's causal upper triangle is skipped), recomputes p = exp(s - lse) there and adds its
column sums into those blocks (policies.md §3: "a chunked-query XLA reference that recomputes
exp(s - lse) per query block"). Without lse, a first loop over the same blocks computes it (online
max and sum). The production path on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.kernels import _common

_CHUNK_ELEMENTS = 1 << 22  # float32 elements of one (query chunk, key block) tile of logits (16 MiB)
BLOCK_K = 512  # keys per block


def chunk_size(b: int, hq: int, t: int, s: int) -> int:
    """Power of two in [8, 512] query rows, smaller when a [B,Hq,chunk,min(s, BLOCK_K)] tile would be large."""
    c = 512
    while c > 8 and b * hq * c * min(s, BLOCK_K) > _CHUNK_ELEMENTS:
        c //= 2
    return min(c, 1 << max(0, (t - 1).bit_length()))


def column_mass(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                key_positions: jax.Array, *, scale: float, lse: jax.Array | None = None,
                chunk: int | None = None, block_k: int | None = None) -> jax.Array:
    """queries [B,Hq,T,D], keys [B,Hkv,S,D] -> float32 [B,Hkv,S]; lse optional [B,Hq,T]."""
    b, hq, t, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    c = chunk or chunk_size(b, hq, t, s)
    bk = block_k or min(BLOCK_K, _common.round_up(s, 8))
    tp, sp = _common.round_up(t, c), _common.round_up(s, bk)
    n, nk = tp // c, sp // bk
    q = _common.pad_axis(queries, 2, tp).reshape(b, hkv, g, n, c, d)
    qpos = _common.pad_axis(query_positions, 1, tp, -1)
    kpos = _common.pad_axis(key_positions, 2, sp, -1)
    start, end, _ = _common.key_block_ranges(qpos, kpos, c, bk)
    kb = _common.pad_axis(keys, 2, sp).reshape(b, hkv, nk, bk, d).transpose(2, 0, 1, 3, 4)
    kpb = kpos.reshape(b, hkv, nk, bk).transpose(2, 0, 1, 3)[:, :, :, None, None, :]  # [nK,B,Hkv,1,1,bk]
    qpb = qpos.reshape(b, n, c)
    has_lse = lse is not None
    lse_c = (_common.pad_axis(lse.astype(jnp.float32), 2, tp) if has_lse
             else jnp.zeros((b, hq, tp), jnp.float32)).reshape(b, hkv, g, n, c)

    def step(acc, xs):
        qc, qpc, lc, lo, hi = xs  # [B,Hkv,G,c,D], [B,c], [B,Hkv,G,c], [], []
        qp = qpc[:, None, None, :, None]

        def logits(j):  # masked logits [B,Hkv,G,c,bk] and their visibility
            lg = jnp.einsum("bhgcd,bhsd->bhgcs", qc, kb[j], precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * scale
            visible = (kpb[j] >= 0) & (kpb[j] <= qp)
            return jnp.where(visible, lg, -jnp.inf), visible

        if has_lse:
            row_lse = lc
        else:
            def lse_step(j, ml):
                m, total = ml
                lg, _ = logits(j)
                m_new = jnp.maximum(m, jnp.max(lg, axis=-1))
                return m_new, total * jnp.exp(m - m_new) + jnp.sum(jnp.exp(lg - m_new[..., None]), axis=-1)

            m, total = lax.fori_loop(lo, hi, lse_step, (jnp.full(lc.shape, -1e30, jnp.float32), jnp.zeros_like(lc)))
            row_lse = m + jnp.log(jnp.where(total > 0, total, 1.0))

        def mass_step(j, acc):
            lg, visible = logits(j)
            p = jnp.where(visible, jnp.exp(lg - row_lse[..., None]), 0.0)
            return acc.at[j].add(jnp.sum(p, axis=(2, 3)))

        return lax.fori_loop(lo, hi, mass_step, acc), None

    xs = (jnp.moveaxis(q, 3, 0), jnp.moveaxis(qpb, 1, 0), jnp.moveaxis(lse_c, 3, 0), start, end)
    acc, _ = lax.scan(step, jnp.zeros((nk, b, hkv, bk), jnp.float32), xs)
    return acc.transpose(1, 2, 0, 3).reshape(b, hkv, sp)[:, :, :s]


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
