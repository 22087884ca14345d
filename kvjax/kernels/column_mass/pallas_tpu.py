"""Column mass on TPU: the shared two-pass Mosaic kernels over all prompt queries."""

from __future__ import annotations

import jax

from kvjax.kernels import _scores_tpu


def column_mass(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                key_positions: jax.Array, *, scale: float, lse: jax.Array | None = None,
                interpret=False, block_q: int = 256, block_k: int = 512) -> jax.Array:
    """queries [B,Hq,T,D], keys [B,Hkv,S,D] of one dtype, lse [B,Hq,T] or None -> [B,Hkv,S] f32.

    Without lse the first (flash-forward-like, no values) pass computes it.
    """
    b, hq, t, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q5 = queries.reshape(b, hkv, g, t, d)
    lse5 = None if lse is None else lse.reshape(b, hkv, g, 1, t)
    out = _scores_tpu.score_moments(q5, keys, query_positions, key_positions, scale=scale,
                                    moments=("sum",), group_reduce="sum", lse=lse5, block_q=block_q,
                                    block_k=block_k, interpret=interpret)
    return out["sum"]
