"""The elementwise pieces by which Gemma 2 / Gemma 3 differ from Llama (used by kvjax.models.llama).

- RMSNorm scales by (1 + weight), in float32 before the cast back (HF's Gemma2/3RMSNorm);
- embeddings are multiplied by sqrt(hidden_size) rounded to the model dtype;
- tanh soft-capping of attention logits and of the final logits (Gemma 2): `kvjax.kernels.attention.softcap`,
  applied by the attention op and by `llama.output_logits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.models.config import ModelConfig


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma RMSNorm over the last axis: `x * rsqrt(mean(x^2) + eps) * (1 + weight)` in float32, cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def embed_scale(cfg: ModelConfig) -> jax.Array:
    """sqrt(hidden_size) in the model dtype (HF casts the scale to the embedding dtype first)."""
    return jnp.asarray(cfg.hidden_size**0.5, cfg.jnp_dtype)

