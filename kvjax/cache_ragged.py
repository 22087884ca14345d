"""A decode-time cache that stores only what it keeps: per-layer storage, each layer its own size.

`KVCache` holds every layer and head in one `[L, B, Hkv, C, D]` buffer, so budgets that vary by
layer (PyramidKV, CAKE) or by head (Ada-KV) pay for the largest count everywhere. `RaggedCache`
is built from a compressed `KVCache` once prefill (and the question) are done, for decoding
without decode-time eviction. Each layer is one of:

  DenseLayer      k, v [B, Hkv, C_l, D], pos [B, Hkv, C_l]: a per-layer capacity C_l (layer-wise
                  budgets: every head of a row keeps the same count).
  SegmentedLayer  k, v [B, S_l, D], pos, seg [B, S_l]: a flat buffer per row in which each KV head
                  owns one contiguous segment, start[b, h] .. end[b, h], of its kept entries plus
                  `room` free slots (head-wise budgets). seg is the head of each slot, -1 on the
                  tail past the row's last segment.

pos is the original position of each entry, -1 where empty. `fill [B, Hkv]` is the next write slot
of each head (entries are kept first in each head's slots, by position; the decode step appends).
Layer shapes differ, so the layers are a tuple (one pytree leaf set per layer), and the forward
(`kvjax.models.forward.extend`) runs the same layer code over them in a Python loop instead of a scan:
the cache offers the layout interface of `KVCache` (`write_layer`, `layer_keys`, `check_model`,
`num_valid`, `row_entries`, `nbytes`, `shardings`). Attention reads a dense layer as
`kvjax.kernels.attention.Keys` and a segmented one as `SegmentedKeys`. Models with sliding-window
layers keep their rolling buffers in `local` (a `KVCache`, as in the dense layout).

The layout (`Layout`: per layer ("dense", C_l) or ("segmented", S_l)) is static: it is chosen on
the host from the kept counts (`choose_layout`), rounded up to a granule so that calls whose counts
differ a little share one compilation.

A layer is any storage with this interface: `kind`, `pos` (its slot count on the last axis), `fill`,
`keys()` (what attention reads), `append(k, v, p)`, `head_counts()`, `row_kv_bytes(itemsize)`,
`kv_nbytes()`, `shardings(mesh)`; `kvjax.cache_quant_ragged` puts quantized forms of both kinds in the
same container (codes and scales, and a full-precision window per head).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from kvjax.cache import CACHE_AXES, KVCache
from kvjax.sharding import logical_sharding
from kvjax.kernels.attention import Keys, SegmentedKeys

# per layer: ("dense", C_l) or ("segmented", S_l)
Layout = tuple[tuple[str, int], ...]


def _entries(pos: jax.Array) -> jax.Array:
    """Entries per row of one layer's positions [B, ...] (-1 = empty): [B] float32."""
    return (pos >= 0).reshape(pos.shape[0], -1).sum(-1).astype(jnp.float32)


@struct.dataclass
class DenseLayer:
    k: jax.Array  # [B, Hkv, C, D]
    v: jax.Array
    pos: jax.Array  # [B, Hkv, C] int32, -1 = empty
    fill: jax.Array  # [B, Hkv] int32: next write slot

    @property
    def kind(self) -> str:
        return "dense"

    def head_counts(self) -> jax.Array:
        return (self.pos >= 0).sum(-1)

    def keys(self) -> Keys:
        return Keys(k=self.k, v=self.v, pos=self.pos)

    def append(self, k: jax.Array, v: jax.Array, p: jax.Array) -> DenseLayer:
        return append_token(self, k, v, p)

    def row_kv_bytes(self, itemsize: int = 2) -> jax.Array:
        return _entries(self.pos) * (2 * self.k.shape[-1] * itemsize)

    def kv_nbytes(self) -> int:
        return int(self.k.nbytes) + int(self.v.nbytes)

    def shardings(self, mesh: Mesh) -> DenseLayer:
        axes = CACHE_AXES[1:]  # batch, kv_heads, cache_seq, head_dim
        full, meta = logical_sharding(axes, self.k.shape, mesh), logical_sharding(axes[:3], self.pos.shape, mesh)
        return DenseLayer(k=full, v=full, pos=meta, fill=logical_sharding(axes[:2], self.fill.shape, mesh))


@struct.dataclass
class SegmentedLayer:
    k: jax.Array  # [B, S, D]
    v: jax.Array
    pos: jax.Array  # [B, S] int32, -1 = empty
    seg: jax.Array  # [B, S] int32: the KV head owning each slot, -1 past the last segment
    start: jax.Array  # [B, Hkv] int32
    end: jax.Array  # [B, Hkv] int32 (exclusive)
    fill: jax.Array  # [B, Hkv] int32: next write slot

    @property
    def kind(self) -> str:
        return "segmented"

    def head_counts(self) -> jax.Array:
        H = self.start.shape[-1]
        onehot = (self.seg[..., None] == jnp.arange(H)) & (self.pos >= 0)[..., None]
        return onehot.sum(1)

    def keys(self) -> SegmentedKeys:
        return SegmentedKeys(k=self.k, v=self.v, pos=self.pos, seg=self.seg, num_kv_heads=self.start.shape[-1])

    def append(self, k: jax.Array, v: jax.Array, p: jax.Array) -> SegmentedLayer:
        return append_token(self, k, v, p)

    def row_kv_bytes(self, itemsize: int = 2) -> jax.Array:
        return _entries(self.pos) * (2 * self.k.shape[-1] * itemsize)

    def kv_nbytes(self) -> int:
        return int(self.k.nbytes) + int(self.v.nbytes)

    def shardings(self, mesh: Mesh) -> SegmentedLayer:
        """Rows over "data"; a row's segments stay together (they hold every head)."""
        flat = logical_sharding(("batch", None, None), self.k.shape, mesh)
        rows = logical_sharding(("batch", None), self.pos.shape, mesh)
        return SegmentedLayer(k=flat, v=flat, pos=rows, seg=rows, start=rows, end=rows, fill=rows)


@struct.dataclass
class RaggedCache:
    layers: tuple  # one storage per (global) layer: DenseLayer | SegmentedLayer, or their quantized forms
    local: KVCache | None = None  # rolling buffers of sliding-window layers, as in `KVCache.local`

    stacked = False  # one storage per layer: the forward loops over the layers

    @property
    def capacity(self) -> int:
        """The most slots any layer stores (per head for dense layers, per row for segmented ones)."""
        return max(size for _, size in self.layout)

    @property
    def layout(self) -> Layout:
        return tuple((x.kind, int(x.pos.shape[-1])) for x in self.layers)

    def num_valid(self) -> jax.Array:
        """Entries in use per (layer, row, head) [L, B, Hkv]."""
        return jnp.stack([x.head_counts() for x in self.layers])

    def row_entries(self) -> jax.Array:
        """Entries per row, summed over layers and heads: [B] float32."""
        return sum(_entries(x.pos) for x in self.layers)

    def row_kv_bytes(self, itemsize: int = 2) -> jax.Array:
        """Key and value bytes of the entries each row holds, [B] float32, at `itemsize` bytes per element
        (quantized layers: their codes, scales and zero points, and their window's entries at `itemsize`)."""
        return sum(x.row_kv_bytes(itemsize) for x in self.layers)

    def kv_nbytes(self) -> int:
        """Bytes of the key and value buffers (quantized layers: codes, scales, zero points and window)."""
        return sum(x.kv_nbytes() for x in self.layers)

    def nbytes(self) -> int:
        """Bytes of every buffer (keys, values, positions, segment ids and bounds, write slots, and the
        rolling buffers of sliding-window layers)."""
        own = sum(sum(int(a.nbytes) for a in jax.tree.leaves(x)) for x in self.layers)
        return own + (0 if self.local is None else self.local.nbytes())

    def check_model(self, cfg: Any) -> None:
        """ValueError unless this cache fits the model `cfg` (one storage per global layer)."""
        if len(self.layers) != cfg.num_global_layers or bool(cfg.local_layer_ids) != (self.local is not None):
            raise ValueError(f"ragged cache: {len(self.layers)} layers and local buffers: {self.local is not None}; "
                             f"this {cfg.family} model needs {cfg.num_global_layers} global layers and local "
                             f"buffers: {bool(cfg.local_layer_ids)}")

    def write_slots(self, n: int) -> None:
        """None: each head appends at its own `fill` slot (`write_layer`)."""
        return None

    def layer_keys(self, l: int) -> Keys | SegmentedKeys:
        """What attention reads in layer `l` (a Python int: the layers differ in shape)."""
        return self.layers[l].keys()

    def write_layer(self, l: int, k: jax.Array, v: jax.Array, positions: jax.Array, slots: Any = None,
                    enabled: Any = None) -> RaggedCache:
        """Appends one token per row (k, v [B,Hkv,1,D], positions [B,1]) at each head's next slot of layer
        `l`; `slots` is ignored (a head writes at its `fill`). Only decode steps write here."""
        if k.shape[2] != 1 or enabled is not None:
            raise ValueError("a RaggedCache is written one decode token at a time (n = 1)")
        layers = list(self.layers)
        layers[l] = layers[l].append(k[:, :, 0], v[:, :, 0], positions[:, 0])
        return self.replace(layers=tuple(layers))

    def shardings(self, mesh: Mesh) -> RaggedCache:
        return RaggedCache(layers=tuple(x.shardings(mesh) for x in self.layers),
                           local=None if self.local is None else self.local.shardings(mesh))

    def kept_positions(self) -> list[list[list[list[int]]]]:
        """Host: the sorted positions each (layer, row, head) holds, [L][B][Hkv] lists."""
        out = []
        for x in self.layers:
            pos = np.asarray(jax.device_get(x.pos))
            if x.kind == "dense":
                out.append([[sorted(int(p) for p in ph if p >= 0) for ph in pb] for pb in pos])
            else:
                seg = np.asarray(jax.device_get(x.seg))
                H = x.fill.shape[-1]
                out.append([[sorted(int(p) for p, s in zip(pb, sb) if p >= 0 and s == h) for h in range(H)]
                            for pb, sb in zip(pos, seg)])
        return out


def round_up(n: int, granule: int) -> int:
    return max(granule, granule * math.ceil(n / granule)) if granule > 1 else n


def choose_layout(counts: np.ndarray, room: int, granule: int = 1, align: int = 1) -> Layout:
    """The static layout for kept counts [L, B, Hkv] (host) plus `room` free slots per head.

    Per layer: C = the largest head count (rounded up to `granule`) + room for a dense layer, or
    S = the largest row total over heads (rounded up) + Hkv * room for a segmented one; the layer is
    segmented when that stores fewer slots before rounding (head-wise budgets), dense otherwise
    (layer-wise ones). align > 1: every segment starts on a multiple of `align` slots (quantized keys
    whose scales are shared by `align` consecutive slots, `kvjax.cache_quant_ragged`), so S holds
    Hkv * (align - 1) more and is a multiple of align; a layer is segmented only if that still stores less.
    """
    counts = np.asarray(counts)
    H = counts.shape[2]
    layout = []
    for c in counts:
        most, total = int(c.max(initial=0)), int(c.sum(-1).max(initial=0))
        if total + H * (align - 1) < H * most:  # heads of a row differ: segments store less
            size = round_up(total, granule) + H * (room + align - 1)
            layout.append(("segmented", -(-size // align) * align))
        else:
            layout.append(("dense", round_up(most, granule) + room))
    return tuple(layout)


def _kept_first(valid: jax.Array, pos: jax.Array) -> jax.Array:
    """Per head, slot indices with the valid ones first in position order [..., C]."""
    big = jnp.iinfo(jnp.int32).max
    return jnp.argsort(jnp.where(valid, pos, big), axis=-1, stable=True).astype(jnp.int32)


def from_cache(cache: KVCache, layout: Layout, room: int, align: int = 1) -> RaggedCache:
    """The entries of `cache` (its valid slots) in the `layout` (traceable; layout, room and align static).

    The layout must hold every head's entries plus `room` (`choose_layout` of `cache.num_valid()`, with the
    same `align`); entries beyond it would be dropped. align: each segment's length (entries + room) is
    rounded up to a multiple of it, so segments start on multiples of align. Sliding-window buffers
    (`cache.local`) are carried as they are.
    """
    L, B, H, C, D = cache.k.shape
    if len(layout) != L:
        raise ValueError(f"layout has {len(layout)} layers, the cache {L}")
    layers = []
    for l, (kind, size) in enumerate(layout):
        valid, pos = cache.valid[l], cache.pos[l]
        order = _kept_first(valid, pos)  # [B, H, C]
        n = valid.sum(-1).astype(jnp.int32)  # [B, H]
        if kind == "dense":
            idx = order[..., :size] if size <= C else jnp.pad(order, ((0, 0), (0, 0), (0, size - C)))
            filled = jnp.arange(size) < n[..., None]
            k = jnp.take_along_axis(cache.k[l], idx[..., None], axis=2)
            v = jnp.take_along_axis(cache.v[l], idx[..., None], axis=2)
            p = jnp.where(filled, jnp.take_along_axis(pos, idx, axis=2), -1)
            zero = jnp.zeros((), k.dtype)
            layers.append(DenseLayer(k=jnp.where(filled[..., None], k, zero), v=jnp.where(filled[..., None], v, zero),
                                     pos=p, fill=n))
            continue
        length = -(-(n + room) // align) * align
        end = jnp.cumsum(length, axis=-1).astype(jnp.int32)
        start = end - length
        j = jnp.arange(size, dtype=jnp.int32)
        head = jnp.sum(j[None, :, None] >= end[:, None, :], axis=-1).astype(jnp.int32)  # [B, S]
        inside = head < H
        h = jnp.minimum(head, H - 1)
        off = j[None] - jnp.take_along_axis(start, h, axis=1)
        filled = inside & (off < jnp.take_along_axis(n, h, axis=1))
        src = jnp.take_along_axis(order.reshape(B, H * C), h * C + jnp.clip(off, 0, C - 1), axis=1)  # slot in head h
        flat = h * C + src
        k = jnp.take_along_axis(cache.k[l].reshape(B, H * C, D), flat[..., None], axis=1)
        v = jnp.take_along_axis(cache.v[l].reshape(B, H * C, D), flat[..., None], axis=1)
        p = jnp.where(filled, jnp.take_along_axis(pos.reshape(B, H * C), flat, axis=1), -1)
        zero = jnp.zeros((), k.dtype)
        layers.append(SegmentedLayer(k=jnp.where(filled[..., None], k, zero), v=jnp.where(filled[..., None], v, zero),
                                     pos=p, seg=jnp.where(inside, head, -1), start=start, end=end, fill=start + n))
    return RaggedCache(layers=tuple(layers), local=cache.local)


def append_token(layer: DenseLayer | SegmentedLayer, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array
                 ) -> DenseLayer | SegmentedLayer:
    """Writes one token per (row, head) at its `fill` slot: k_new, v_new [B, Hkv, D]; pos_new [B]
    (-1: a padding step, written as empty and the slot stays free). A full head drops the write."""
    B, H = layer.fill.shape
    pos = jnp.broadcast_to(pos_new[:, None], (B, H)).astype(jnp.int32)
    bi = jnp.arange(B)[:, None]
    if layer.kind == "dense":
        cap = layer.k.shape[2]
        slot = jnp.where(layer.fill < cap, layer.fill, cap)
        idx = (bi, jnp.arange(H)[None, :], slot)
    else:
        slot = jnp.where(layer.fill < layer.end, layer.fill, layer.k.shape[1])
        idx = (bi, slot)
    return layer.replace(
        k=layer.k.at[idx].set(k_new.astype(layer.k.dtype), mode="drop"),
        v=layer.v.at[idx].set(v_new.astype(layer.v.dtype), mode="drop"),
        pos=layer.pos.at[idx].set(pos, mode="drop"),
        fill=layer.fill + (pos >= 0).astype(jnp.int32),
    )
