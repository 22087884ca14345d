"""What attention reads: the key/value sets of the cache layouts, as the attention op's input types.

A cache layout hands the attention op one of these (`kvjax.cache` and `kvjax.cache_ragged` build
them); an attention implementation accepts the kinds it can read and declines the others.

  Keys           k, v [B,Hkv,S,D], pos [B,Hkv,S] int32: dense per-head slots; query i sees slot s
                 iff 0 <= pos[s] <= q_pos[i] (and within the window when given); -1 = not attended.
  SegmentedKeys  k, v [B,S,D], pos, seg [B,S] int32: one flat buffer per row in which KV head h owns
                 the slots whose seg is h (contiguous, in head order); -1 in pos or seg = not attended.
  QuantizedKeys  k, v `kvjax.kv_quant.Quantized` over [B,Hkv,S,...] (codes, scales, zero points; rotated
                 when `config.rotation`), pos [B,Hkv,S]; and a full-precision window rk, rv [B,Hkv,R,D]
                 (not rotated) with rpos [B,Hkv,R] and rslot [B,Hkv,R], the slot each entry stands for
                 (-1 = empty); config: the static `kvjax.kv_quant.KVQuant`.
  QuantizedSegmentedKeys  the segmented layout quantized: k, v `Quantized` over [B,S,...] (one flat run per
                 row, KV head h owning the slots whose seg is h, as in `SegmentedKeys`; rotated when
                 `config.rotation`), pos, seg [B,S] (-1 = not attended: empty, or held by the window);
                 and the per-head full-precision window rk, rv [B,Hkv,R,D] (not rotated), rpos [B,Hkv,R].
"""

from __future__ import annotations

from typing import Any

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


@struct.dataclass
class QuantizedKeys:
    k: Any
    v: Any
    pos: jax.Array
    rk: jax.Array
    rv: jax.Array
    rpos: jax.Array
    rslot: jax.Array
    config: Any = struct.field(pytree_node=False, default=None)


@struct.dataclass
class QuantizedSegmentedKeys:
    k: Any
    v: Any
    pos: jax.Array
    seg: jax.Array
    rk: jax.Array
    rv: jax.Array
    rpos: jax.Array
    config: Any = struct.field(pytree_node=False, default=None)
