"""What attention reads: the key/value sets of the cache layouts, as the attention op's input types.

A cache layout hands the attention op one of these (`kvjax.cache` and `kvjax.cache_ragged` build
them); an attention implementation accepts the kinds it can read and declines the others.

  Keys           k, v [B,Hkv,S,D], pos [B,Hkv,S] int32: dense per-head slots; query i sees slot s
                 iff 0 <= pos[s] <= q_pos[i] (and within the window when given); -1 = not attended.
  SegmentedKeys  k, v [B,S,D], pos, seg [B,S] int32: one flat buffer per row in which KV head h owns
                 the slots whose seg is h (contiguous, in head order); -1 in pos or seg = not attended.
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class Keys:
    k: jax.Array
    v: jax.Array
    pos: jax.Array


@struct.dataclass
class SegmentedKeys:
    k: jax.Array
    v: jax.Array
    pos: jax.Array
    seg: jax.Array
    num_kv_heads: int = struct.field(pytree_node=False, default=1)
