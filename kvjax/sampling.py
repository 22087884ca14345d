"""Token sampling: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampler:
    """temperature 0 is greedy; top_k / top_p restrict the candidates before sampling."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be a positive int or None")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] or None")

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits [B, V] float32 -> token ids [B] int32."""
        if self.temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, self.top_k)[0][..., -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if self.top_p is not None and self.top_p < 1:
            sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
            cutoff = jnp.min(jnp.where(before < self.top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
            logits = jnp.where(logits < cutoff, -jnp.inf, logits)
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
