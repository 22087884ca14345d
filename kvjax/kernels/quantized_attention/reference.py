"""XLA reference for one decode step over quantized keys and values (also the CPU path).

The codes are dequantized with `kvjax.kv_quant.dequantize` (qwix's (code - zero) * scale), then attended
as `decode_attention.reference` does; a Pallas kernel must give the same numbers while reading only the
packed bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import kv_quant
from kvjax.kernels._common import MASK_VALUE
from kvjax.kv_quant import KVQuant, Quantized


def quantized_decode_attention(query: jax.Array, k: Quantized, v: Quantized, visible: jax.Array, *, scale: float,
                               config: KVQuant, softcap: float | None = None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """query [B,Hq,D] (rotated when the configuration rotates); k, v quantized over [B,Hkv,S',...];
    visible [B,Hkv,S] bool (S <= S': slots past S are never attended).
    Returns out [B,Hq,D] float32 (softmax over the visible slots; 0 for a head that sees none), lse
    [B,Hq] float32 (MASK_VALUE for a head that sees none) and logits [B,Hkv,G,S] float32 (scaled and
    soft-capped; MASK_VALUE where not visible)."""
    B, Hq, D = query.shape
    Hkv, S = visible.shape[1:]
    keys = kv_quant.dequantize(k, config)[:, :, :S]
    values = kv_quant.dequantize(v, config)[:, :, :S]
    q = query.reshape(B, Hkv, Hq // Hkv, D).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhsd->bhgs", q, keys, precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    mask = visible[:, :, None, :]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    vals = jnp.where(visible[..., None], values, 0.0)
    out = jnp.einsum("bhgs,bhsd->bhgd", e / jnp.where(total > 0, total, 1.0), vals, precision=lax.Precision.HIGHEST)
    lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), MASK_VALUE)
    return out.reshape(B, Hq, D), lse.reshape(B, Hq), s
