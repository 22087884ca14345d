"""Column mass on GPU: the shared two-pass Pallas Triton kernels (6.6-7.4x XLA on an H200)."""

from __future__ import annotations

import jax

from kvjax.kernels import _scores_gpu


def column_mass(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                key_positions: jax.Array, *, scale: float, lse: jax.Array | None = None,
                interpret: bool = False, block_q: int = 64, block_k: int = 64) -> jax.Array:
    """queries [B,Hq,T,D], keys [B,Hkv,S,D] of one dtype, lse [B,Hq,T] or None -> [B,Hkv,S] f32."""
    b, hq, t, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q5 = queries.reshape(b, hkv, g, t, d)
    lse5 = None if lse is None else lse.reshape(b, hkv, g, 1, t)
    out = _scores_gpu.score_moments(q5, keys, query_positions, key_positions, scale=scale,
                                    moments=("sum",), group_reduce="sum", lse=lse5, block_q=block_q,
                                    block_k=block_k, interpret=interpret)
    return out["sum"]
