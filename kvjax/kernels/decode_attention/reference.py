"""XLA reference for one decode step over a masked fixed-capacity cache (also the CPU path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def decode_attention(query: jax.Array, keys: jax.Array, values: jax.Array, valid: jax.Array, *,
                     scale: float) -> tuple[jax.Array, jax.Array]:
    """query [B,Hq,D], keys/values [B,Hkv,S,D], valid [B,Hkv,S] -> (out [B,Hq,D], probs [B,Hkv,G,S] f32)."""
    b, hq, d = query.shape
    hkv = keys.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bhsd->bhgs", q, keys, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    mask = valid[:, :, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total > 0, total, 1.0)
    v = jnp.where(valid[..., None], values, 0).astype(jnp.float32)  # stale / NaN slots must not leak
    out = jnp.einsum("bhgs,bhsd->bhgd", probs, v, precision=lax.Precision.HIGHEST)
    return out.reshape(b, hq, d).astype(query.dtype), probs
