"""XLA reference for window scores: materialises the [B,Hkv,G,w,S] window attention.

Cheap because w is small (policies.md §1.7: cost w·S·d per head); it is also the production
path on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kernels import _common


def window_probs(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                 key_positions: jax.Array, *, scale: float) -> jax.Array:
    """Causal float32 softmax of the window queries: [B,Hkv,G,w,S], zeros where not visible."""
    s, visible = _common.grouped_logits(queries, keys, query_positions, key_positions, scale=scale)
    return _common.masked_softmax(s, visible)


def window_scores(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                  key_positions: jax.Array, *, scale: float, group_reduce: str | None,
                  moments: tuple[str, ...]) -> dict[str, jax.Array]:
    """Moments over the window of the per-key attention, reduced over the group; float32."""
    dtype = _common.common_dtype(queries, keys)
    p = window_probs(queries.astype(dtype), keys.astype(dtype), query_positions, key_positions, scale=scale)
    out = {}
    for moment in moments:
        c = _common.moment_contribution(moment, p)
        out[moment] = _common.group_reduce_rows(jnp.sum(c, axis=3), group_reduce, axis=2)
    return out
