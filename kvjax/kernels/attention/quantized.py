"""Attention over a quantized cache (`QuantizedKeys`): the quantized slots through the quantized decode
kernel (codes dequantized inside it), the full-precision window in XLA, merged by their log-sum-exp.

Keys and values of the quantized part are stored rotated when the configuration rotates: the query is
rotated alike (q.k is unchanged, H being orthonormal) and that part's output rotated back (H symmetric).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import kv_quant
from kvjax.kernels._common import MASK_VALUE
from kvjax.kernels.attention.keys import Keys, QuantizedKeys
from kvjax.kernels.attention.reference import attend, softcap as apply_softcap
from kvjax.kernels.quantized_attention import quantized_decode_attention


def window(q: jax.Array, keys: QuantizedKeys, q_pos: jax.Array, scale: float, cap: float | None
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The window's part: out [B,Hq,D] f32, lse [B,Hq] (MASK_VALUE when empty), logits [B,Hkv,G,R].
    keys: any key set with a window (rk, rv [B,Hkv,R,D], rpos [B,Hkv,R])."""
    B, Hq, D = q.shape
    Hkv = keys.rk.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, D).astype(jnp.float32)
    s = apply_softcap(jnp.einsum("bhgd,bhrd->bhgr", qg, keys.rk.astype(jnp.float32)) * scale, cap)
    see = ((keys.rpos >= 0) & (keys.rpos <= q_pos[:, :1, None]))[:, :, None, :]
    s = jnp.where(see, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(see, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    v = jnp.where(see[:, :, 0, :, None], keys.rv.astype(jnp.float32), 0.0)  # [B,Hkv,R,D]
    out = jnp.einsum("bhgr,bhrd->bhgd", e / jnp.where(total > 0, total, 1.0), v)
    lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), MASK_VALUE)
    return out.reshape(B, Hq, D), lse.reshape(B, Hq), s


def merge(out_q: jax.Array, lse_q: jax.Array, out_r: jax.Array, lse_r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two attention parts over disjoint keys (out [B,Hq,D], lse [B,Hq], MASK_VALUE = saw nothing) as one
    softmax over both: out [B,Hq,D] float32 (0 where neither saw a key), lse [B,Hq] (0 there)."""
    lse = jnp.logaddexp(lse_q, lse_r)
    seen = jnp.maximum(lse_q, lse_r) > MASK_VALUE / 2
    wq, wr = jnp.exp(lse_q - lse), jnp.exp(lse_r - lse)
    out = jnp.where(seen[..., None], wq[..., None] * out_q + wr[..., None] * out_r, 0.0)
    return out, jnp.where(seen, lse, 0.0)


def decode(q: jax.Array, keys: QuantizedKeys, q_pos: jax.Array, *, scale: float, softcap: float | None,
           with_probs: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One query per row, q [B,Hq,1,D]: out [B,Hq,1,D] (q dtype), lse [B,Hq,1] and, when asked, the
    probabilities over the slots [B,Hkv,G,1,S] (the window's entries at their slots)."""
    cfg = keys.config
    B, Hq, _, D = q.shape
    Hkv, S = keys.pos.shape[1:]
    G = Hq // Hkv
    visible = (keys.pos >= 0) & (keys.pos <= q_pos[:, :1, None])
    q1 = q[:, :, 0]
    out_q, lse_q, logits = quantized_decode_attention(kv_quant.rotate(q1, cfg), keys.k, keys.v, visible, scale=scale,
                                                      config=cfg, softcap=softcap)
    out_q = kv_quant.rotate(out_q, cfg)  # H @ H = I: rotated back
    out_r, lse_r, logits_r = window(q1, keys, q_pos, scale, softcap)
    out, lse = merge(out_q, lse_q, out_r, lse_r)
    probs = None
    if with_probs:
        lg = lse.reshape(B, Hkv, G, 1)
        p = jnp.where(visible[:, :, None, :], jnp.exp(logits - lg), 0.0)
        pr = jnp.where(logits_r > MASK_VALUE / 2, jnp.exp(logits_r - lg), 0.0)  # [B,Hkv,G,R]
        slot = jnp.where(keys.rslot >= 0, keys.rslot, S)  # out of range: dropped
        bi, hi, gi = (jnp.arange(n).reshape(shape) for n, shape in ((B, (B, 1, 1, 1)), (Hkv, (1, Hkv, 1, 1)),
                                                                     (G, (1, 1, G, 1))))
        p = p.at[bi, hi, gi, slot[:, :, None, :]].add(pr, mode="drop")
        probs = p[:, :, :, None, :]
    return out[:, :, None].astype(q.dtype), lse[:, :, None], probs


def dequantized_keys(keys: QuantizedKeys) -> Keys:
    """The same entries in full precision, the window after the slots (its entries at their positions):
    k, v [B,Hkv,S+R,D] float32, pos [B,Hkv,S+R]."""
    cfg = keys.config
    S = keys.pos.shape[-1]
    k = kv_quant.rotate(kv_quant.dequantize(keys.k, cfg)[:, :, :S], cfg)
    v = kv_quant.rotate(kv_quant.dequantize(keys.v, cfg)[:, :, :S], cfg)
    return Keys(k=jnp.concatenate([k, keys.rk.astype(jnp.float32)], axis=2),
                v=jnp.concatenate([v, keys.rv.astype(jnp.float32)], axis=2),
                pos=jnp.concatenate([keys.pos, keys.rpos], axis=2))


def chunk(q: jax.Array, keys: QuantizedKeys, q_pos: jax.Array, *, scale: float, window: int | None,
          softcap: float | None) -> jax.Array:
    """Several queries against a quantized cache (not a decode step): attention over a dequantized
    copy (`dequantized_keys`). out [B,Hq,n,D]."""
    full = dequantized_keys(keys)
    return attend(q.astype(jnp.float32), full.k, full.v, q_pos, full.pos, scale, window=window,
                  softcap=softcap)[0].astype(q.dtype)
