"""A decode cache that stores the kept keys and values quantized (`kvjax.kv_quant`), behind the layout
interface of `KVCache`, so that the same forward decodes from it and every policy composes with it.

Order of operations: the prompt is prefilled, scored and compacted in full precision (and the question
fed); only then `from_cache` quantizes what is kept, once. Decode appends go to each head's next slot
(`fill`), into a full-precision window of at most `residual` entries (`window_size`: no more than
decoding can put in it, since a window larger than the decode room is memory never used); when it is full, all of them are
quantized at once into their slots (a fixed-size flush: no shape changes, no recompilation). Slots
keep their index throughout, so a decode-time policy's per-slot state and its evictions (valid bits)
work as in the dense layout, and attention reads exactly the entries the policy scores
(`kvjax.kernels.attention.QuantizedKeys`: the codes of the quantized slots, the window in full precision).

Slot reuse (`reuse_slots`, decode-time eviction with per-token scales): a decode append takes its head's
first free slot, as in the dense `KVCache` (a slot an eviction freed), so the cache needs the dense plan's
capacity (about budget + 1) however many tokens are decoded, instead of a slot per decode step. The window
then records the slot each entry stands for (`wslot`), `windowed` marks those slots, and a flush scatters
the window's codes to them; an entry evicted while in the window frees its slot at once (its window entry
becomes a hole, skipped by the flush). fill - flushed still counts the window's entries (fill and flushed
are counters here, not slots). Per-channel keys (groups of G consecutive slots sharing a scale) keep
consecutive appends: a freed slot in the middle of a group cannot take a new scale.

Shapes (L global layers, B rows, Hkv heads, C slots, D head_dim, R = window_size(config, room)):
  k, v      `kv_quant.Quantized` over [L, B, Hkv, C', ...]: C' = C rounded up to the key group for
            per-channel keys; slots < `flushed` hold codes
  rk, rv    [L, B, Hkv, R, D] model dtype: entry j holds slot `flushed + j` while `flushed + j < fill`
  pos, valid [L, B, Hkv, C]; fill, flushed [L, B, Hkv] int32
  wslot     [L, B, Hkv, R] int32 (slot reuse only, else None): the slot of window entry j (-1: none)
  windowed  [L, B, Hkv, C] bool (slot reuse only, else None): the slot's entry is in the window
  local     Gemma's sliding-window rolling buffers, kept in full precision (bounded by the window,
            never evicted or compacted)
Keys are stored rotated when the configuration rotates (`kv_quant.rotate`); the window is not.

One storage's code (`QuantizedStorage`): the window, the append, the flush, the key set attention reads
and the bytes are written once, over a storage whose arrays may carry a leading layer axis. `at` selects
one layer's arrays: `(l,)` in this stacked cache, `()` in a storage that is one layer's own (the ragged
layout's quantized layers, `kvjax.cache_quant_ragged`). A storage's slots are either per head
(`flat = False`: pos [..., B, Hkv, C]) or one flat run per row in which each head owns a segment
(`flat = True`: pos, seg [B, S], the head's last slot bound `end` [B, Hkv]); the window is per head
in both. The window's size W is the storage's own (`rk.shape[-2]`): it flushes when it holds W entries.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from kvjax import kv_quant
from kvjax.cache import KVCache
from kvjax.sharding import logical_sharding
from kvjax.kernels.attention import QuantizedKeys
from kvjax.kv_quant import KVQuant, Quantized


def _rows(a: Any, at: tuple) -> Any:
    """Layer `at` of a (the whole array when at is ())."""
    return a[at] if at else a


def _set(a: jax.Array, at: tuple, x: jax.Array) -> jax.Array:
    return a.at[at].set(x) if at else x


def _slot_index(flat: bool, at: tuple, slot: jax.Array) -> tuple:
    """The scatter index of each head's slot `slot` [B, Hkv, ...]: (*at, b, h, slot), or (*at, b, slot) in
    a flat storage (a head's slots are slots of its row)."""
    B, H = slot.shape[:2]
    bi = jnp.arange(B).reshape((B,) + (1,) * (slot.ndim - 1))
    if flat:
        return (*at, bi, slot)
    return (*at, bi, jnp.arange(H).reshape((1, H) + (1,) * (slot.ndim - 2)), slot)


def _take(a: jax.Array, slots: jax.Array, flat: bool) -> jax.Array:
    """a at each head's `slots` [..., B, Hkv, n] (in range): a [..., B, Hkv, C, *x] gives [..., B, Hkv, n, *x];
    a flat a [..., B, S, *x] gives the same shape (the slots index the row)."""
    x = a.ndim - slots.ndim + (1 if flat else 0)  # trailing axes of a past the slot axis
    if flat:
        lead = slots.shape[:-2]
        idx = slots.reshape(*lead, -1)
        out = jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * x), axis=idx.ndim - 1)
        return out.reshape(slots.shape + a.shape[a.ndim - x:])
    return jnp.take_along_axis(a, slots.reshape(slots.shape + (1,) * x), axis=slots.ndim - 1)


def key_group(config: KVQuant) -> int:
    """Slots that share a key scale: the slot group for per-channel keys, else 1."""
    return config.slot_group if config.key_axis == "channel" else 1


def quantize_slots(k: jax.Array, v: jax.Array, below: jax.Array, config: KVQuant) -> tuple[Quantized, Quantized]:
    """k, v [..., C, D] (slots on axis -2) quantized where `below` [..., C] (the others zeroed), the slot axis
    padded to a multiple of the key group for per-channel keys; rotated first when the configuration rotates."""
    C = k.shape[-2]
    G = key_group(config)
    Cp = -(-C // G) * G
    pad = lambda a: jnp.pad(a, ((0, 0),) * (a.ndim - 2) + ((0, Cp - C), (0, 0)))  # noqa: E731
    below = jnp.pad(below, ((0, 0),) * (below.ndim - 1) + ((0, Cp - C),))
    qk = kv_quant.quantize(pad(kv_quant.rotate(k, config)), config, per_channel=G > 1, valid=below)
    qv = kv_quant.quantize(pad(kv_quant.rotate(v, config)), config, valid=below)
    return qk, qv


def window_size(config: KVQuant, room: int | None) -> int:
    """The full-precision window's entries per head: as many as decoding can put in it (`room` decode
    appends, after the remainder of a partial key group) before a window of `residual` would flush, at
    most max(residual, 1); `room=None` (not known): max(residual, 1)."""
    most = max(config.residual, 1)
    if room is None:
        return most
    G = key_group(config)
    need = room if G == 1 else -(-(G - 1 + room) // G) * G
    return max(min(most, need), 1)


def window_from(k: jax.Array, v: jax.Array, fill: jax.Array, flushed: jax.Array, size: int, flat: bool
                ) -> tuple[jax.Array, jax.Array]:
    """The full-precision window [..., B, Hkv, size, D] of a storage whose slots flushed .. fill - 1 of each
    head (fill, flushed [..., B, Hkv]) are not quantized: entry j <- slot flushed + j (zeros past fill)."""
    src = flushed[..., None] + jnp.arange(size)
    inside = src < fill[..., None]
    last = k.shape[-2] - 1
    gather = lambda a: jnp.where(inside[..., None], _take(a, jnp.minimum(src, last), flat),  # noqa: E731
                                 jnp.zeros((), a.dtype))
    return gather(k), gather(v)


class QuantizedStorage:
    """The code shared by every quantized storage (see the module docstring). A subclass is a struct with
    k, v (`Quantized`), rk, rv, pos, fill, flushed, config, and `valid` (the stacked cache, where a
    decode-time policy clears valid bits; elsewhere pos >= 0 marks an entry), or seg and end (flat)."""

    flat = False

    @property
    def window(self) -> int:
        return self.rk.shape[-2]

    def _valid(self, at: tuple) -> jax.Array:
        valid = getattr(self, "valid", None)
        return _rows(self.pos, at) >= 0 if valid is None else _rows(valid, at)

    def _limit(self, at: tuple) -> Any:
        """One past each head's last slot: the slot count, or a flat storage's segment ends [B, Hkv]."""
        return _rows(self.end, at) if self.flat else self.pos.shape[-1]

    def _per_slot(self, head: jax.Array, at: tuple) -> jax.Array:
        """A per-head value [..., B, Hkv] at each slot: [..., B, Hkv, 1] (broadcasts over a head's slots), or
        the value of each slot's head in a flat storage [B, S] (head 0 past the last segment)."""
        if not self.flat:
            return head[..., None]
        return jnp.take_along_axis(head, jnp.maximum(_rows(self.seg, at), 0), axis=-1)

    def _codes_visible(self, at: tuple) -> jax.Array:
        """The entries that hold codes (valid, below their head's `flushed`; with slot reuse: not windowed)."""
        if self.reuses_slots:
            return self._valid(at) & ~_rows(self.windowed, at)
        flushed = self._per_slot(_rows(self.flushed, at), at)
        return self._valid(at) & (jnp.arange(self.pos.shape[-1]) < flushed)

    @property
    def reuses_slots(self) -> bool:
        return getattr(self, "wslot", None) is not None

    def _window_view(self, at: tuple) -> tuple[jax.Array, jax.Array]:
        """The window's positions rpos [B, Hkv, W] (-1 = empty) and the slot each entry stands for, rslot."""
        if self.reuses_slots:
            rslot = _rows(self.wslot, at)
            inside = rslot >= 0
        else:
            flushed, fill = _rows(self.flushed, at), _rows(self.fill, at)
            rslot = flushed[..., None] + jnp.arange(self.window)
            inside = rslot < fill[..., None]
        src = jnp.minimum(rslot, self.pos.shape[-1] - 1)
        rpos = jnp.where(inside & _take(self._valid(at), src, self.flat), _take(_rows(self.pos, at), src, self.flat),
                         -1)
        return rpos, jnp.where(inside, rslot, -1)

    def _append(self, at: tuple, k: jax.Array, v: jax.Array, p: jax.Array, slot: jax.Array | None = None) -> Any:
        """Appends one token per row (k, v [B,Hkv,D], p [B]; -1 = written nowhere) in the window, standing for
        each head's `fill` slot (with slot reuse: `slot` [B,Hkv], its first free slot); a head with no slot
        left drops it. Flushes the heads whose window is full."""
        fill, flushed = _rows(self.fill, at), _rows(self.flushed, at)
        B, H = fill.shape
        bi, hi = jnp.arange(B)[:, None], jnp.arange(H)[None, :]
        if self.reuses_slots:
            taken = _rows(self.valid, at) | _rows(self.windowed, at)
            write = (p >= 0)[:, None] & ~jnp.take_along_axis(taken, slot[..., None], axis=-1)[..., 0]
            target = slot
        else:
            write = (p >= 0)[:, None] & (fill < self._limit(at))  # [B,Hkv]
            target = fill
        j = jnp.where(write, fill - flushed, self.window)  # out of range: dropped
        idx = _slot_index(self.flat, at, jnp.where(write, target, self.pos.shape[-1]))
        new = dict(rk=self.rk.at[(*at, bi, hi, j)].set(k.astype(self.rk.dtype), mode="drop"),
                   rv=self.rv.at[(*at, bi, hi, j)].set(v.astype(self.rv.dtype), mode="drop"),
                   pos=self.pos.at[idx].set(jnp.broadcast_to(p[:, None], (B, H)).astype(self.pos.dtype), mode="drop"),
                   fill=_set(self.fill, at, fill + write.astype(jnp.int32)))
        if getattr(self, "valid", None) is not None:
            new["valid"] = self.valid.at[idx].set(True, mode="drop")
        if self.reuses_slots:
            new["windowed"] = self.windowed.at[idx].set(True, mode="drop")
            new["wslot"] = self.wslot.at[(*at, bi, hi, j)].set(target, mode="drop")
        s = self.replace(**new)
        full = _rows(s.fill, at) - flushed >= self.window
        # module-level branches with operands (not closures): an eager call (outside jit) then reuses
        # one compiled cond per shape instead of compiling a new one per call
        return jax.lax.cond(jnp.any(full), _flush_branch, _unchanged_branch, s, at, full)

    def _flush(self, at: tuple, full: jax.Array) -> Any:
        """Quantizes the window of the heads `full` [B,Hkv] into its slots [flushed, flushed + W)."""
        W, cfg = self.window, self.config
        flushed = _rows(self.flushed, at)
        G = key_group(cfg)
        if self.reuses_slots:  # each entry to its own slot; holes (evicted while in the window) nowhere
            slots = _rows(self.wslot, at)
            inside = slots >= 0
            heads = full[..., None] & inside
        else:
            slots = flushed[..., None] + jnp.arange(W)
            inside = slots < _rows(self.fill, at)[..., None]
            heads = jnp.broadcast_to(full[..., None], slots.shape)
        qk = kv_quant.quantize(kv_quant.rotate(_rows(self.rk, at), cfg), cfg, per_channel=G > 1, valid=inside)
        qv = kv_quant.quantize(kv_quant.rotate(_rows(self.rv, at), cfg), cfg, valid=inside)
        new = dict(k=_put(self.k, at, qk, slots, heads, G, self.flat), v=_put(self.v, at, qv, slots, heads, 1, self.flat),
                   flushed=_set(self.flushed, at, jnp.where(full, flushed + W, flushed)))
        if self.reuses_slots:
            cleared = _slot_index(self.flat, at, jnp.where(heads, slots, self.pos.shape[-1]))
            new["windowed"] = self.windowed.at[cleared].set(False, mode="drop")
            new["wslot"] = _set(self.wslot, at, jnp.where(full[..., None], -1, slots))
        return self.replace(**new)

    def row_kv_bytes(self, itemsize: int = 2) -> jax.Array:
        """Key and value bytes of the entries each row holds, [B] float32: a quantized entry's codes, scales
        and zero points (per-channel key scales shared by their slot group), a window entry's full
        precision at `itemsize` bytes per element (2: a 16-bit cache's)."""
        slots = math.prod(self.k.codes.shape[:-1])
        per_entry = (kv_quant.nbytes(self.k) + kv_quant.nbytes(self.v)) / slots
        at = ()
        b = self.pos.ndim - (2 if self.flat else 3)  # the row axis
        rows = lambda x: jnp.sum(x, axis=tuple(i for i in range(x.ndim) if i != b)).astype(jnp.float32)  # noqa: E731
        quantized, entries = rows(self._codes_visible(at)), rows(self._valid(at))
        return quantized * per_entry + (entries - quantized) * (2 * self.rk.shape[-1] * itemsize)

    def kv_nbytes(self) -> int:
        """Bytes of keys and values: codes, scales, zero points and the full-precision window."""
        return kv_quant.nbytes(self.k) + kv_quant.nbytes(self.v) + int(self.rk.nbytes) + int(self.rv.nbytes)


@struct.dataclass
class QuantizedKVCache(QuantizedStorage):
    k: Quantized
    v: Quantized
    rk: jax.Array
    rv: jax.Array
    pos: jax.Array
    valid: jax.Array
    fill: jax.Array
    flushed: jax.Array
    local: KVCache | None = None
    wslot: jax.Array | None = None
    windowed: jax.Array | None = None
    config: KVQuant = struct.field(pytree_node=False, default=KVQuant())

    stacked = True

    @property
    def capacity(self) -> int:
        return self.pos.shape[3]

    def write_slots(self, n: int) -> jax.Array:
        """[L, B, Hkv, 1]: each head's next write slot (decode appends one token per step): `fill`, or with
        slot reuse its first slot neither valid nor in the window (as `KVCache.write_slots`)."""
        if n != 1:
            raise ValueError("a QuantizedKVCache is written one decode token at a time (n = 1)")
        if self.reuses_slots:
            return jnp.argmin(self.valid | self.windowed, axis=-1)[..., None].astype(jnp.int32)
        return self.fill[..., None]

    def check_model(self, cfg: Any) -> None:
        if self.pos.shape[0] != cfg.num_global_layers or bool(cfg.local_layer_ids) != (self.local is not None):
            raise ValueError(f"quantized cache: {self.pos.shape[0]} layers and local buffers: {self.local is not None}; "
                             f"this {cfg.family} model needs {cfg.num_global_layers} global layers and local "
                             f"buffers: {bool(cfg.local_layer_ids)}")

    def layer_keys(self, l: Any) -> QuantizedKeys:
        """Layer `l`'s key set: the quantized slots (those below `flushed`) and the window."""
        at = (l,)
        rpos, rslot = self._window_view(at)
        take = lambda q: jax.tree.map(lambda a: a[l], q)  # noqa: E731
        return QuantizedKeys(k=take(self.k), v=take(self.v), pos=jnp.where(self._codes_visible(at), self.pos[l], -1),
                             rk=self.rk[l], rv=self.rv[l], rpos=rpos, rslot=rslot, config=self.config)

    def write_layer(self, l: Any, k: jax.Array, v: jax.Array, positions: jax.Array, slots: Any = None,
                    enabled: jax.Array | None = None) -> QuantizedKVCache:
        """Appends one token per row (k, v [B,Hkv,1,D] post-RoPE, positions [B,1]; -1 = a padding step,
        written nowhere) at each head's `fill` slot, in the window; flushes the heads whose window is
        full. enabled (traced bool): False drops the write (sliding-window layers under the scan)."""
        if k.shape[2] != 1:
            raise ValueError("a QuantizedKVCache is written one decode token at a time (n = 1)")
        p = positions[:, 0]
        if enabled is not None:
            p = jnp.where(enabled, p, -1)
        slot = None
        if self.reuses_slots:
            slot = (self.write_slots(1)[l] if slots is None else slots)[..., 0]  # slots: [B,Hkv,1], this layer's
        return self._append((l,), k[:, :, 0], v[:, :, 0], p, slot)

    def evict(self, keep: jax.Array) -> QuantizedKVCache:
        """Clears the valid bit (and position) of every slot where `keep [L,B,Hkv,C]` is False; with slot
        reuse, an evicted window entry's slot is free at once (its window entry left as a hole)."""
        valid = self.valid & keep
        out = self.replace(valid=valid, pos=jnp.where(valid, self.pos, -1))
        if not self.reuses_slots:
            return out
        held = jnp.take_along_axis(keep, jnp.maximum(self.wslot, 0), axis=-1)
        return out.replace(windowed=self.windowed & keep, wslot=jnp.where(held, self.wslot, -1))

    def num_valid(self) -> jax.Array:
        return self.valid.sum(-1)

    def row_entries(self) -> jax.Array:
        return self.valid.sum(axis=(0, 2, 3)).astype(jnp.float32)

    def nbytes(self) -> int:
        """Bytes of every buffer: keys and values (`kv_nbytes`), positions, valid bits, the write
        pointers and Gemma's rolling buffers."""
        meta = sum(int(a.nbytes) for a in (self.pos, self.valid, self.fill, self.flushed, self.wslot, self.windowed)
                   if a is not None)
        return self.kv_nbytes() + meta + (0 if self.local is None else self.local.nbytes())

    def shardings(self, mesh: Mesh) -> QuantizedKVCache:
        """Rows over "data", KV heads over "model" (where they divide), for every per-head array."""
        spec = lambda a: logical_sharding(("layers", "batch", "kv_heads") + (None,) * (a.ndim - 3), a.shape,  # noqa: E731
                                          mesh)
        local = None if self.local is None else self.local.shardings(mesh)
        return jax.tree.map(spec, self.replace(local=None)).replace(local=local)


def _flush_branch(cache: Any, at: tuple, full: jax.Array) -> Any:
    return cache._flush(at, full)


def _unchanged_branch(cache: Any, at: tuple, full: jax.Array) -> Any:
    return cache


def _put(store: Quantized, at: tuple, new: Quantized, slots: jax.Array, heads: jax.Array, per_group: int,
         flat: bool) -> Quantized:
    """`new` (quantized rows [B,Hkv,W,...]) written into layer `at` of `store` at each head's `slots`
    [B,Hkv,W], where `heads` [B,Hkv,W] is True; scales per group of `per_group` consecutive slots (the
    first slot a multiple of it) go to slot slots[0] / per_group + i (a flat storage: slots of the row)."""

    def one(buf: jax.Array, rows: jax.Array, per: int) -> jax.Array:
        n = rows.shape[2]
        size = buf.shape[len(at) + (1 if flat else 2)]
        first = slots[..., :1] // per + jnp.arange(n)
        idx = jnp.where(heads[..., :n], slots[..., :n] if per == 1 else first, size)
        return buf.at[_slot_index(flat, at, idx)].set(rows.astype(buf.dtype), mode="drop")

    return Quantized(codes=one(store.codes, new.codes, 1), scale=one(store.scale, new.scale, per_group),
                     zero=None if store.zero is None else one(store.zero, new.zero, per_group))


def from_cache(cache: KVCache, config: KVQuant, room: int | None = None, reuse_slots: bool = False
               ) -> QuantizedKVCache:
    """The entries of a (compressed) dense cache, quantized (traceable; config, room and reuse_slots
    static), with a full-precision window of `window_size(config, room)` entries (`room`: the decode
    appends to come). reuse_slots: decode appends take freed slots (module docstring; per-token scales).

    Each head's write pointer is one past its last valid slot. Per-token scales: every kept entry is
    quantized. Per-channel keys: the whole groups of G slots below the pointer are quantized and the
    remainder starts the full-precision window."""
    D = cache.k.shape[-1]
    config.check(D)
    C = cache.k.shape[3]
    slot = jnp.arange(C)
    fill = jnp.max(jnp.where(cache.valid, slot + 1, 0), axis=-1).astype(jnp.int32)
    G = key_group(config)
    flushed = (fill // G) * G
    qk, qv = quantize_slots(cache.k, cache.v, cache.valid & (slot < flushed[..., None]), config)
    W = window_size(config, room)
    rk, rv = window_from(cache.k, cache.v, fill, flushed, W, flat=False)
    if not reuse_slots:
        return QuantizedKVCache(k=qk, v=qv, rk=rk, rv=rv, pos=cache.pos, valid=cache.valid, fill=fill,
                                flushed=flushed, local=cache.local, config=config)
    if G != 1:
        raise ValueError(f"kv_quant: slot reuse needs per-token scales (key_axis='token'); {config.name} groups "
                         f"{G} consecutive slots per key scale")
    zero = jnp.zeros_like(fill)  # every kept entry is quantized; fill - flushed counts the window's entries
    return QuantizedKVCache(k=qk, v=qv, rk=rk, rv=rv, pos=cache.pos, valid=cache.valid, fill=zero, flushed=zero,
                            local=cache.local, wslot=jnp.full(fill.shape + (W,), -1, jnp.int32),
                            windowed=jnp.zeros(cache.valid.shape, bool), config=config)
