"""Prefill attention without the probability matrix: blocked flash attention in XLA, or jax's splash
attention on TPU.

`flash_attention` computes what `kvjax.models.llama.attend` computes (causal by position over
masked slots), but never holds more than one [block_q, block_k] tile of logits per head: query
blocks run under `lax.scan`, each visiting only the key blocks that can hold a visible key
(`kernels._common.key_block_ranges`: a prefill's causal upper triangle is never computed), with an
online softmax. Blocks that every query of the block sees entirely skip the mask. It returns the
log-sum-exp of each query's logits as well, which the two-pass column mass takes as its first pass.

The block loops have traced trip counts (`lax.fori_loop` over a while loop): the function is for
forward passes (prefill), not reverse-mode differentiation.

`prefill_attention` picks the implementation: on TPU, a prefill's self-attention (keys = the queries'
own tokens) whose length splash's 128-blocks divide runs jax's splash attention (`splash_attention`,
Mosaic, from `jax.experimental.pallas.ops.tpu`; no kvjax kernel), under a `lax.cond` that falls back to
`flash_attention` when a row's real positions do not increase along it (splash is causal by index).
Elsewhere (CPU, GPU, chunks against a cache) it is `flash_attention`. On GPU, jax's cuDNN attention
would need right-padded bf16 prompts and gives no log-sum-exp; the XLA path keeps one code for all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import _compat
from kvjax.kernels import _common
from kvjax.models import gemma

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
) -> tuple[jax.Array, jax.Array]:
    """Causal attention by position over masked slots, blocked, without probabilities.

    q [B,Hq,n,D], k/v [B,Hkv,S,D], q_pos [B,n] (-1 = padding query), k_pos [B,Hkv,S] (-1 = empty).
    Query i sees slot s iff 0 <= k_pos[s] <= q_pos[i] (and q_pos[i] - k_pos[s] < window when given);
    softcap: logits -> softcap * tanh(logits / softcap) first (Gemma 2). As `llama.attend`.
    Returns out [B,Hq,n,D] (q dtype; zeros for a query that sees no slot) and lse [B,Hq,n] float32,
    the log-sum-exp of each query's visible logits (0 for a query that sees none).
    """
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
            return gemma.softcap(s, softcap)

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


SPLASH_BLOCK = 128  # splash attention's default block sizes: the prefill length must be a multiple


def index_causal(q_pos: jax.Array) -> jax.Array:
    """Scalar bool: in every row of q_pos [B,n] the real positions (>= 0) increase along the index, so
    that among real tokens "key position <= query position" is "key index <= query index"."""
    real = q_pos >= 0
    seen = jax.lax.cummax(jnp.where(real, q_pos, -1), axis=1)
    before = jnp.pad(seen[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    return jnp.all(~real | (q_pos > before))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, scale: float, *,
                     window: int | None = None, softcap: float | None = None, interpret: bool = False
                     ) -> tuple[jax.Array, jax.Array]:
    """A prefill's self-attention by jax's splash attention: q [B,Hq,n,D], k/v [B,Hkv,n,D] (the keys of the
    same n tokens), q_pos [B,n] (-1 = padding); n a multiple of SPLASH_BLOCK. Causal by index, padding
    separated by segment ids: equal to `flash_attention` when `index_causal(q_pos)`. Returns out
    [B,Hq,n,D] and lse [B,Hq,n] float32 (zeros for padding queries). interpret: Pallas interpreter (CPU tests).
    """
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    sm, sk = _compat.splash_mask, _compat.splash_kernel
    one = sm.CausalMask((n, n)) if window is None else sm.LocalMask((n, n), window_size=(window - 1, 0), offset=0)
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([one] * G), save_residuals=True,
                                              attn_logits_soft_cap=softcap, interpret=interpret)
    segments = (q_pos >= 0).astype(jnp.int32)

    def group(qg, kh, vh, seg):  # [G,n,D], [n,D], [n,D], [n]: one KV head of one row
        out, (lse,) = kernel(qg, kh, vh, segment_ids=sk.SegmentIds(q=seg, kv=seg))
        return out, lse

    heads = jax.vmap(group, in_axes=(0, 0, 0, None))
    qs = (q * jnp.asarray(scale, q.dtype)).reshape(B, Hkv, G, n, D)
    out, lse = jax.vmap(heads)(qs, k.astype(q.dtype), v.astype(q.dtype), segments)
    real = (q_pos >= 0)[:, None, :]
    out = jnp.where(real[..., None], out.reshape(B, Hq, n, D), 0).astype(q.dtype)
    return out, jnp.where(real, lse.reshape(B, Hq, n).astype(jnp.float32), 0.0)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float,
                      *, window: int | None = None, softcap: float | None = None, own_keys: bool = False
                      ) -> tuple[jax.Array, jax.Array]:
    """`flash_attention`'s result (out [B,Hq,n,D], lse [B,Hq,n]), by splash attention on TPU where it
    applies: own_keys (static) says the keys are the queries' own tokens (k_pos = q_pos per head, a
    prefill). The implementation follows `kvjax.kernels` (`KVJAX_KERNEL_IMPLEMENTATION`: "interpret"
    runs splash in the Pallas interpreter, "xla" forces `flash_attention`)."""
    flash = lambda: flash_attention(q, k, v, q_pos, k_pos, scale, window=window, softcap=softcap)  # noqa: E731
    try:
        impl = _common.resolve_implementation(None, "prefill_attention")
    except RuntimeError:
        impl = "xla"
    if not (own_keys and impl in ("pallas_tpu", "interpret") and _compat.HAS_SPLASH
            and q.shape[2] % SPLASH_BLOCK == 0):
        return flash()
    splash = lambda: splash_attention(q, k, v, q_pos, scale, window=window, softcap=softcap,  # noqa: E731
                                      interpret=impl == "interpret")
    return jax.lax.cond(index_causal(q_pos), splash, flash)
