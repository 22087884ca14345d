"""The ragged decode layout with quantized storage: per-layer storage that holds only what is kept (plus
the decode room), as codes and scales (`kvjax.kv_quant`). `generate(..., kv_quant=..., cache_layout="ragged")`
decodes from it; its output's `cache_layout` is "ragged+quantized".

It is a `kvjax.cache_ragged.RaggedCache` (the same container, forward loop and interface) whose layers
are the quantized forms of the ragged layer kinds:

  QuantizedDenseLayer      layer-wise budgets (PyramidKV, CAKE): one `QuantizedKVCache`-like storage of
                           capacity C_l for the layer (k, v `Quantized` over [B, Hkv, C_l', ...], pos
                           [B, Hkv, C_l]); attention reads it as `QuantizedKeys` (the `quantized`
                           implementation, the same kernel as the stacked quantized cache).
  QuantizedSegmentedLayer  head-wise budgets (Ada-KV): the segmented layer's flat run per row quantized
                           (k, v `Quantized` over [B, S_l', ...], pos, seg [B, S_l], each head's segment
                           end [B, Hkv]); attention reads it as `QuantizedSegmentedKeys` (the
                           `segment_quantized` implementation: dequantized per segment inside the
                           computation).

Both carry a per-head full-precision window rk, rv [B, Hkv, W, D] and write pointers fill, flushed
[B, Hkv], and share the stacked cache's code for the window, the append, the flush, the key set and the
bytes (`kvjax.cache_quant.QuantizedStorage`, one layer's arrays at `at = ()`).

Choices and why:
- **Quantize after the ragged move, per layer.** `from_cache` moves the compressed cache (prefill
  scored and compacted in full precision, question fed) into the ragged layout (`cache_ragged.from_cache`:
  each head's kept entries first, in position order) and quantizes each layer's entries once, as
  `cache_quant.from_cache` does for the stacked cache. Per-token scales are per slot, so every entry gets
  the same codes as in the stacked quantized cache: the two layouts attend over the same values (up to
  the order of summation). Per-channel keys group G consecutive entries of a head: here in position
  order, in the stacked cache in slot order, so the groups (and the codes) are the same only where the
  stacked cache's slots are in position order (as `tests/test_cache_quant_ragged.py` builds them).
- **Segments, not a dense capacity of the largest head, for head-wise budgets.** A dense per-layer capacity
  would pay for the largest head count in every head, which is what the ragged layout exists to avoid;
  the segmented form stores the row's total. The price is one more attention implementation (XLA, no
  Pallas kernel yet, as for the full-precision segments).
- **Per-channel keys (KIVI) in segments**: a key scale is shared by G consecutive slots, so every segment
  starts on a multiple of G and its length (entries + room) is rounded up to one (`choose_layout` and
  `cache_ragged.from_cache` with `align = G`): no group straddles two heads. That costs at most G - 1
  slots per head, and a layer is segmented only when it still stores less than a dense one.
- **The window's size is min(residual, what decoding can put in it)**: W = min(max(residual, 1), room)
  per-token, min(residual, round_up(G - 1 + room, G)) per-channel (the entries below a group boundary
  left over from the quantization, G - 1 at most, plus the decode appends; a multiple of G, as the
  flush writes whole groups). Decode writes at most room - 1 tokens, so a window of W flushes exactly
  when a window of `residual` would (never, when residual >= room): the same entries are quantized as in
  the stacked quantized cache, and a 128-entry full-precision window (the int4 presets) is not paid for
  (`cache_quant.window_size`, which the stacked quantized cache uses too)
  a 16-token decode room. The stacked cache keeps W = max(residual, 1) (the same sizing would shrink it).
- **Flushes in fixed-size groups**: appends go to the window; when a head's window holds W entries they
  are quantized at once into their slots (a `lax.cond`, fixed shapes, no recompilation).
- **No decode-time eviction** (the ragged rule, `engine.api.ragged_supported`): those runs keep the
  stacked quantized cache, and the full cache too (its layer-wise capacity is already uniform).
- **Bytes**: `nbytes` counts every buffer (codes, scales, zero points, window, positions, segment ids and
  bounds, write pointers, Gemma's rolling buffers); `row_kv_bytes` a row's entries: codes + scales per
  quantized entry, 16 bits per element for the window's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from kvjax import cache_ragged
from kvjax.cache import KVCache
from kvjax.cache_quant import QuantizedStorage, key_group, quantize_slots, window_from, window_size
from kvjax.cache_ragged import DenseLayer, Layout, RaggedCache, SegmentedLayer
from kvjax.kernels.attention import QuantizedKeys, QuantizedSegmentedKeys
from kvjax.kv_quant import KVQuant, Quantized
from kvjax.sharding import logical_sharding

LAYOUT_NAME = "ragged+quantized"  # `GenerateOutput.cache_layout` of a run decoded from this layout


@struct.dataclass
class QuantizedDenseLayer(QuantizedStorage):
    k: Quantized  # over [B, Hkv, C', ...]
    v: Quantized
    rk: jax.Array  # [B, Hkv, W, D]
    rv: jax.Array
    pos: jax.Array  # [B, Hkv, C] int32, -1 = empty
    fill: jax.Array  # [B, Hkv] int32: next write slot
    flushed: jax.Array  # [B, Hkv] int32: slots below hold codes
    config: KVQuant = struct.field(pytree_node=False, default=KVQuant())

    @property
    def kind(self) -> str:
        return "dense"

    def head_counts(self) -> jax.Array:
        return (self.pos >= 0).sum(-1)

    def keys(self) -> QuantizedKeys:
        rpos, rslot = self._window_view(())
        return QuantizedKeys(k=self.k, v=self.v, pos=jnp.where(self._codes_visible(()), self.pos, -1), rk=self.rk,
                             rv=self.rv, rpos=rpos, rslot=rslot, config=self.config)

    def append(self, k: jax.Array, v: jax.Array, p: jax.Array) -> QuantizedDenseLayer:
        return self._append((), k, v, p)

    def shardings(self, mesh: Mesh) -> QuantizedDenseLayer:
        """Rows over "data", KV heads over "model" (where they divide)."""
        spec = lambda a: logical_sharding(("batch", "kv_heads") + (None,) * (a.ndim - 2), a.shape, mesh)  # noqa: E731
        return jax.tree.map(spec, self)


@struct.dataclass
class QuantizedSegmentedLayer(QuantizedStorage):
    k: Quantized  # over [B, S', ...]
    v: Quantized
    rk: jax.Array  # [B, Hkv, W, D]
    rv: jax.Array
    pos: jax.Array  # [B, S] int32, -1 = empty
    seg: jax.Array  # [B, S] int32: the KV head owning each slot, -1 past the last segment
    end: jax.Array  # [B, Hkv] int32: one past each head's last slot
    fill: jax.Array  # [B, Hkv] int32: next write slot (a slot of the row)
    flushed: jax.Array  # [B, Hkv] int32
    config: KVQuant = struct.field(pytree_node=False, default=KVQuant())

    flat = True

    @property
    def kind(self) -> str:
        return "segmented"

    def head_counts(self) -> jax.Array:
        H = self.fill.shape[-1]
        return ((self.seg[..., None] == jnp.arange(H)) & (self.pos >= 0)[..., None]).sum(1)

    def keys(self) -> QuantizedSegmentedKeys:
        rpos, _ = self._window_view(())
        return QuantizedSegmentedKeys(k=self.k, v=self.v, pos=jnp.where(self._codes_visible(()), self.pos, -1),
                                      seg=self.seg, rk=self.rk, rv=self.rv, rpos=rpos, config=self.config)

    def append(self, k: jax.Array, v: jax.Array, p: jax.Array) -> QuantizedSegmentedLayer:
        return self._append((), k, v, p)

    def shardings(self, mesh: Mesh) -> QuantizedSegmentedLayer:
        """Rows over "data"; a row's segments stay together (they hold every head)."""
        spec = lambda a: logical_sharding(("batch",) + (None,) * (a.ndim - 1), a.shape, mesh)  # noqa: E731
        return jax.tree.map(spec, self)


def segment_align(config: KVQuant) -> int:
    """The slot multiple every segment starts on (`choose_layout`'s align): the key group."""
    return key_group(config)


def choose_layout(counts, room: int, config: KVQuant, granule: int = 1) -> Layout:
    """`cache_ragged.choose_layout` for quantized storage (segments aligned to the key group)."""
    return cache_ragged.choose_layout(counts, room, granule, align=segment_align(config))


def quantize_layer(layer: DenseLayer | SegmentedLayer, config: KVQuant, window: int
                   ) -> QuantizedDenseLayer | QuantizedSegmentedLayer:
    """A ragged layer's entries quantized (traceable): each head's whole key groups below its write pointer
    (every entry with per-token scales), the rest in a window of `window` entries."""
    G = key_group(config)
    if layer.kind == "dense":
        flushed = (layer.fill // G) * G
        below = (layer.pos >= 0) & (jnp.arange(layer.pos.shape[-1]) < flushed[..., None])
        qk, qv = quantize_slots(layer.k, layer.v, below, config)
        rk, rv = window_from(layer.k, layer.v, layer.fill, flushed, window, flat=False)
        return QuantizedDenseLayer(k=qk, v=qv, rk=rk, rv=rv, pos=layer.pos, fill=layer.fill, flushed=flushed,
                                   config=config)
    flushed = layer.start + ((layer.fill - layer.start) // G) * G  # segments start on multiples of G
    own = jnp.take_along_axis(flushed, jnp.maximum(layer.seg, 0), axis=1)
    below = (layer.pos >= 0) & (layer.seg >= 0) & (jnp.arange(layer.pos.shape[-1]) < own)
    qk, qv = quantize_slots(layer.k, layer.v, below, config)
    rk, rv = window_from(layer.k, layer.v, layer.fill, flushed, window, flat=True)
    return QuantizedSegmentedLayer(k=qk, v=qv, rk=rk, rv=rv, pos=layer.pos, seg=layer.seg, end=layer.end,
                                   fill=layer.fill, flushed=flushed, config=config)


def from_cache(cache: KVCache, layout: Layout, room: int, config: KVQuant) -> RaggedCache:
    """The entries of a compressed dense `cache` in the ragged `layout` (`choose_layout` of its kept counts,
    with the same room and config), quantized (traceable; layout, room and config static). Sliding-window
    buffers (`cache.local`) are carried as they are, in full precision."""
    config.check(cache.k.shape[-1])
    ragged = cache_ragged.from_cache(cache, layout, room, align=segment_align(config))
    W = window_size(config, room)
    return ragged.replace(layers=tuple(quantize_layer(x, config, W) for x in ragged.layers))
