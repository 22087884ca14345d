"""Public dispatcher for window scores."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvjax.kernels import _common, _dispatch
from kvjax.kernels.window_scores import pallas_gpu, pallas_tpu, reference

TABLE = _dispatch.table("window_scores", xla=reference, pallas_tpu=pallas_tpu, pallas_gpu=pallas_gpu)


def window_scores(queries: jax.Array, keys: jax.Array, query_positions: jax.Array,
                  key_positions: jax.Array, *, scale: float, group_reduce: str | None = "mean",
                  moments: Sequence[str] = ("sum",),
                  implementation: str | Sequence[str] | None = None) -> dict[str, jax.Array]:
    """Attention mass that a window of queries puts on every key, per KV head.

    Args:
      queries: [B,Hq,w,D] post-RoPE queries of the last w positions (or learned lookahead tokens).
      keys: [B,Hkv,S,D], any float dtype; Hq must be a multiple of Hkv (query head h uses KV head h // G).
      query_positions: [B,w] int32 absolute positions of the queries.
      key_positions: [B,Hkv,S] int32 position of each slot, -1 for an empty slot.
      scale: softmax scale applied to q.k.
      group_reduce: "mean" | "sum" | "max" over the G query heads of a KV group, or None to keep them.
      moments: names among "sum" (sum_i p), "sumsq" (sum_i p^2), "entropy" (-sum_i p log(p + 1e-10)).
      implementation: None (Pallas on TPU, XLA on GPU and CPU: see _dispatch.OP_DEFAULT_ORDER), "xla", "pallas_tpu", "pallas_gpu", "interpret",
        or a sequence of them (the first available; see kvjax.kernels._dispatch).

    Query i sees key j iff 0 <= key_positions[j] <= query_positions[i]; the softmax runs over those
    keys in float32. Returns {moment: float32 [B,Hkv,S]} ([B,Hkv,G,S] when group_reduce is None);
    keys no query sees get 0 and a query that sees no key contributes 0.
    """
    impl = TABLE.resolve(implementation)
    scale = _common.check_scale(scale)
    moments = _common.check_moments(moments)
    group_reduce = _common.check_group_reduce(group_reduce)
    b, hkv, _, _ = _common.check_qk(queries, keys)
    _common.check_array("query_positions", query_positions, 2, "int")
    _common.check_array("key_positions", key_positions, 3, "int")
    _common.check_dims("query_positions", query_positions.shape, (b, queries.shape[2]), "[B,w]")
    _common.check_dims("key_positions", key_positions.shape, (b, hkv, keys.shape[2]), "[B,Hkv,S]")
    dtype = _common.common_dtype(queries, keys)
    queries, keys = queries.astype(dtype), keys.astype(dtype)
    query_positions = query_positions.astype(jnp.int32)
    key_positions = key_positions.astype(jnp.int32)
    return TABLE[impl](queries, keys, query_positions, key_positions, scale=scale, group_reduce=group_reduce,
                       moments=moments)
