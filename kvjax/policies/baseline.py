"""Random: a seeded baseline that scores every entry with a hash of (seed, layer, head, position)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations
from kvjax.policies.base import Plan, check_int
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32 integer hash on uint32 (wrapping arithmetic)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seed: int, layer: jax.Array, head: jax.Array, pos: jax.Array) -> jax.Array:
    """Uniform [0, 1) float32 from mix(seed ^ mix(layer ^ mix(head ^ mix(pos)))), top 24 bits.

    Depends only on (seed, layer, KV head, position): the same token gets the same score whatever
    its row, slot or batch, so a sequence is treated alike alone and in a padded batch.
    """
    u = lambda x: jnp.asarray(x).astype(jnp.uint32)  # noqa: E731
    h = _mix(u(seed) ^ _mix(u(layer) ^ _mix(u(head) ^ _mix(u(pos)))))
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Random(PrefillPolicy):
    """Keeps a pseudo-random subset of the prompt per (layer, head); no protected tokens."""

    name = "random"
    chunked_prefill_reason = None

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("seed", self.seed, 0)
        if self.seed >= 2**32:
            raise ValueError(f"seed must be < 2**32 (a uint32 hash key), got {self.seed}")

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        L, B, H, C = cache.valid.shape
        layer = jnp.arange(L)[:, None, None, None]
        head = jnp.arange(H)[None, None, :, None]
        s = hash_uniform(self.seed, layer, head, jnp.maximum(cache.pos, 0))
        return Scored(jnp.where(cache.valid, s, 0.0), jnp.zeros_like(cache.valid))
