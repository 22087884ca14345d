"""Public dispatcher for decode attention that also returns the attention probabilities."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from kvjax.kernels import _common, _dispatch
from kvjax.kernels.decode_attention import pallas_gpu, pallas_tpu, reference

TABLE = _dispatch.table("decode_attention", xla=reference, pallas_tpu=pallas_tpu, pallas_gpu=pallas_gpu)


def decode_attention(query: jax.Array, keys: jax.Array, values: jax.Array, valid: jax.Array, *,
                     scale: float, implementation: str | Sequence[str] | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """One decode step of attention over a masked cache of fixed capacity.

    Args:
      query: [B,Hq,D] the step's (post-RoPE) query.
      keys, values: [B,Hkv,S,D] cache contents (any float dtype); query head h uses KV head h // G.
      valid: [B,Hkv,S] bool; invalid slots are never attended and their contents never read into
        the result (they may hold stale data or NaN).
      scale: softmax scale applied to q.k.
      implementation: None | "xla" | "pallas_tpu" | "pallas_gpu" | "interpret", or a sequence of them
        (the first available; see kvjax.kernels._dispatch).

    Returns (out [B,Hq,D] in the query dtype, probs [B,Hkv,G,S] float32 softmax over valid slots,
    zero on invalid ones). A row with no valid slot gives out = 0 and probs = 0.
    """
    impl = TABLE.resolve(implementation)
    scale = _common.check_scale(scale)
    _common.check_array("query", query, 3, "float")
    _common.check_array("keys", keys, 4, "float")
    _common.check_array("values", values, 4, "float")
    _common.check_array("valid", valid, 3, "bool")
    b, hq, d = query.shape
    _, hkv, s, _ = keys.shape
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv}) for GQA")
    _common.check_dims("keys", keys.shape, (b, hkv, s, d), "[B,Hkv,S,D]")
    _common.check_dims("values", values.shape, (b, hkv, s, d), "[B,Hkv,S,D]")
    _common.check_dims("valid", valid.shape, (b, hkv, s), "[B,Hkv,S]")
    dtype = _common.common_dtype(keys, values)
    keys, values = keys.astype(dtype), values.astype(dtype)
    return TABLE[impl](query, keys, values, valid, scale=scale)
