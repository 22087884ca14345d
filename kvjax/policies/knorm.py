"""KNorm: keep the keys with the smallest L2 norm (policies.md §9)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations
from kvjax.policies.allocators import Allocation
from kvjax.policies.base import Plan, PlanRequest, as_i32, check_int
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored


@dataclasses.dataclass(frozen=True, kw_only=True)
class KNorm(PrefillPolicy):
    """s[h, j] = -||k_j||_2 in float32 per KV head; no protected tokens.

    skip_layers: layers left uncompressed (KVCache-Factory's L2Norm skips layers 0 and 1; the
    budget then applies per compressed layer). `knorm_kvpress` compresses every layer.
    """

    name = "knorm"
    chunked_prefill_reason = None

    skip_layers: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.skip_layers, tuple):
            raise TypeError(f"skip_layers must be a tuple of layer indices, got {self.skip_layers!r}")
        for i, l in enumerate(self.skip_layers):
            check_int(f"skip_layers[{i}]", l, 0)

    def allocate(self, req: PlanRequest) -> Allocation:
        alloc = super().allocate(req)
        kept = [l not in self.skip_layers for l in range(req.num_layers)]
        whole = (False,) * len(req.lengths)
        return dataclasses.replace(
            alloc,
            counts=tuple(r if k else req.lengths for r, k in zip(alloc.counts, kept)),
            bound=tuple(r if k else req.lengths for r, k in zip(alloc.bound, kept)),
            compressed=tuple(r if k else whole for r, k in zip(alloc.compressed, kept)),
        )

    def head_counts(self, plan: Plan, scored: Scored, cache: KVCache, obs: Observations) -> jax.Array:
        counts = super().head_counts(plan, scored, cache, obs)
        skipped = jnp.isin(jnp.arange(counts.shape[0]), jnp.asarray(self.skip_layers or (-1,)))
        return jnp.where(skipped[:, None, None], as_i32(plan.lengths)[None, :, None], counts)

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        k = cache.k.astype(jnp.float32)
        s = -jnp.sqrt(jnp.sum(k * k, axis=-1))
        return Scored(jnp.where(cache.valid, s, 0.0), jnp.zeros_like(cache.valid))
