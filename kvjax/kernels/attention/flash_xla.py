"""Blocked flash attention in XLA: the prefill path that never materialises probabilities.

`flash_attention` computes what `reference.attend` computes (causal by position over masked slots),
but never holds more than one [block_q, block_k] tile of logits per head: query blocks run under
`lax.scan`, each visiting only the key blocks that can hold a visible key
(`kernels._common.key_block_ranges`: a prefill's causal upper triangle is never computed), with an
online softmax. Blocks that every query of the block sees entirely skip the mask. It returns the
log-sum-exp of each query's logits as well, which the two-pass column mass takes as its first pass.

The block ranges are shared by the rows of one call, so in a batch of unequal lengths the shorter rows
would compute their padding's blocks for the longer ones. On CPU (the default) a batch runs row by row
(`per_row`, `lax.map`), each row with its own ranges: a padded batch then costs what its rows cost one by
one. Elsewhere the rows stay together, where a batched tile keeps the device busy.

The block loops have traced trip counts (`lax.fori_loop` over a while loop): the function is for
forward passes (prefill), not reverse-mode differentiation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kernels import _common
from kvjax.kernels.attention.reference import softcap as apply_softcap

BLOCK_Q = 512  # query rows per block (times the query group G in one tile)
BLOCK_K = 512  # keys per block
_NEG = -1e30  # the running max before any key: finite, so a row that sees nothing stays 0, never NaN


def _blocks(n: int, target: int) -> tuple[int, int]:
    """(block, padded length): one block of n rounded up to 8 when n <= target, else target."""
    block = min(target, _common.round_up(max(n, 1), 8))
    return block, _common.round_up(n, block)


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float,
    *, window: int | None = None, softcap: float | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
    per_row: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention by position over masked slots, blocked, without probabilities.

    q [B,Hq,n,D], k/v [B,Hkv,S,D], q_pos [B,n] (-1 = padding query), k_pos [B,Hkv,S] (-1 = empty).
    Query i sees slot s iff 0 <= k_pos[s] <= q_pos[i] (and q_pos[i] - k_pos[s] < window when given);
    softcap: logits -> softcap * tanh(logits / softcap) first (Gemma 2). As `reference.attend`.
    per_row: run the rows one at a time, each visiting only its own blocks (None: on CPU, when B > 1).
    Returns out [B,Hq,n,D] (q dtype; zeros for a query that sees no slot) and lse [B,Hq,n] float32,
    the log-sum-exp of each query's visible logits (0 for a query that sees none).
    """
    if per_row is None:
        per_row = q.shape[0] > 1 and jax.default_backend() == "cpu"
    if per_row:
        def one_row(row):
            out, lse = flash_attention(*(x[None] for x in row), scale, window=window, softcap=softcap,
                                       block_q=block_q, block_k=block_k, per_row=False)
            return out[0], lse[0]

        return jax.lax.map(one_row, (q, k, v, q_pos, k_pos))
    B, Hq, n, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, n_pad = _blocks(n, block_q)
    bk, s_pad = _blocks(S, block_k)
    nq, nk = n_pad // bq, s_pad // bk
    q_pos = _common.pad_axis(q_pos.astype(jnp.int32), 1, n_pad, -1)
    k_pos = _common.pad_axis(k_pos.astype(jnp.int32), 2, s_pad, -1)
    start, end, full = _common.key_block_ranges(q_pos, k_pos, bq, bk, window)
    qb = _common.pad_axis(q, 2, n_pad).reshape(B, Hkv, G, nq, bq, D).transpose(3, 0, 1, 2, 4, 5)
    kb = _common.pad_axis(k, 2, s_pad).reshape(B, Hkv, nk, bk, D).transpose(2, 0, 1, 3, 4)
    vb = _common.pad_axis(v, 2, s_pad).reshape(B, Hkv, nk, bk, D).transpose(2, 0, 1, 3, 4)
    kpb = k_pos.reshape(B, Hkv, nk, bk).transpose(2, 0, 1, 3)[:, :, :, None, None, :]  # [nK,B,Hkv,1,1,bk]
    qpb = q_pos.reshape(B, nq, bq).transpose(1, 0, 2)[:, :, None, None, :, None]  # [nQ,B,1,1,bq,1]

    def one_query_block(_, xs):
        qi, qp, lo, hi, full_i = xs  # [B,Hkv,G,bq,D], [B,1,1,bq,1], [], [], [nK]

        def logits(j):
            s = jnp.einsum("bhgnd,bhsd->bhgns", qi, kb[j], preferred_element_type=jnp.float32) * scale
            return apply_softcap(s, softcap)

        def update(carry, s, j):
            m, l, acc = carry
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bhgns,bhsd->bhgnd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        def masked(j, carry):
            kp = kpb[j]
            visible = (kp >= 0) & (kp <= qp)
            if window is not None:
                visible &= kp > qp - window
            return update(carry, jnp.where(visible, logits(j), -jnp.inf), j)

        def unmasked(j, carry):
            return update(carry, logits(j), j)

        def body(j, carry):
            return jax.lax.cond(full_i[j], unmasked, masked, j, carry)

        m0 = jnp.full((B, Hkv, G, bq), _NEG, jnp.float32)
        init = (m0, jnp.zeros((B, Hkv, G, bq), jnp.float32), jnp.zeros((B, Hkv, G, bq, D), jnp.float32))
        m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        return None, (out.astype(q.dtype), lse)

    _, (out, lse) = jax.lax.scan(one_query_block, None, (qb, qpb, start, end, full))
    out = out.transpose(1, 2, 3, 0, 4, 5).reshape(B, Hq, n_pad, D)[:, :, :n]
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(B, Hq, n_pad)[:, :, :n]
    return out, lse
