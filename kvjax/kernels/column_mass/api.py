"""Public dispatcher for column mass (H2O's prefill score)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvjax.kernels import _common, _dispatch
from kvjax.kernels.column_mass import pallas_gpu, pallas_tpu, reference

TABLE = _dispatch.table("column_mass", xla=reference, pallas_tpu=pallas_tpu, pallas_gpu=pallas_gpu)


def column_mass(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                key_positions: jax.Array, *, scale: float, lse: jax.Array | None = None,
                implementation: str | Sequence[str] | None = None) -> jax.Array:
    """Attention mass that every causal prompt query puts on each key, summed over the group.

    Args:
      queries: [B,Hq,T,D] all prompt queries (post-RoPE).
      keys: [B,Hkv,S,D], any float dtype; query head h uses KV head h // (Hq // Hkv).
      query_positions: [B,T] int32, -1 for a padding query (contributes nothing).
      key_positions: [B,Hkv,S] int32, -1 for an empty slot (never attended).
      scale: softmax scale applied to q.k.
      lse: optional [B,Hq,T] float32 log-sum-exp of each query's visible logits (from the flash
        pass); computed by a first pass when None.
      implementation: None | "xla" | "pallas_tpu" | "pallas_gpu" | "interpret", or a sequence of them
        (the first available; see kvjax.kernels._dispatch).

    Returns float32 [B,Hkv,S]: sum over queries i and group members g of softmax_i(s)[j], where
    query i sees key j iff 0 <= key_positions[j] <= query_positions[i].
    """
    impl = TABLE.resolve(implementation)
    scale = _common.check_scale(scale)
    b, hkv, g, _ = _common.check_qk(queries, keys)
    t = queries.shape[2]
    _common.check_array("query_positions", query_positions, 2, "int")
    _common.check_array("key_positions", key_positions, 3, "int")
    _common.check_dims("query_positions", query_positions.shape, (b, t), "[B,T]")
    _common.check_dims("key_positions", key_positions.shape, (b, hkv, keys.shape[2]), "[B,Hkv,S]")
    if lse is not None:
        _common.check_array("lse", lse, 3, "float")
        _common.check_dims("lse", lse.shape, (b, hkv * g, t), "[B,Hq,T]")
        lse = lse.astype(jnp.float32)
    dtype = _common.common_dtype(queries, keys)
    queries, keys = queries.astype(dtype), keys.astype(dtype)
    query_positions = query_positions.astype(jnp.int32)
    key_positions = key_positions.astype(jnp.int32)
    return TABLE[impl](queries, keys, query_positions, key_positions, scale=scale, lse=lse)
