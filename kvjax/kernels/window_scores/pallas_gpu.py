"""Window scores on GPU: the shared two-pass Pallas Triton kernels (never run on a GPU yet)."""

from __future__ import annotations

import jax

from kvjax.kernels import _scores_gpu


def window_scores(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                  key_positions: jax.Array, *, scale: float, group_reduce: str | None,
                  moments: tuple[str, ...], interpret: bool = False, block_q: int = 64,
                  block_k: int = 64) -> dict[str, jax.Array]:
    """queries [B,Hq,w,D], keys [B,Hkv,S,D] of one dtype; see ``kvjax.kernels.window_scores``."""
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    q5 = queries.reshape(b, hkv, hq // hkv, w, d)
    return _scores_gpu.score_moments(q5, keys, query_positions, key_positions, scale=scale,
                                     moments=moments, group_reduce=group_reduce, block_q=block_q,
                                     block_k=block_k, interpret=interpret)
