"""A decode cache that stores the kept keys and values quantized (`kvjax.kv_quant`), behind the layout
interface of `KVCache`, so that the same forward decodes from it and every policy composes with it.

Order of operations: the prompt is prefilled, scored and compacted in full precision (and the question
fed); only then `from_cache` quantizes what is kept, once. Decode appends go to each head's next slot
(`fill`), into a full-precision window of `residual` entries; when it is full, all of them are
quantized at once into their slots (a fixed-size flush: no shape changes, no recompilation). Slots
keep their index throughout, so a decode-time policy's per-slot state and its evictions (valid bits)
work as in the dense layout, and attention reads exactly the entries the policy scores
(`kvjax.kernels.attention.QuantizedKeys`: the codes of the quantized slots, the window in full precision).

Shapes (L global layers, B rows, Hkv heads, C slots, D head_dim, R = max(residual, 1)):
  k, v      `kv_quant.Quantized` over [L, B, Hkv, C', ...]: C' = C rounded up to the key group for
            per-channel keys; slots < `flushed` hold codes
  rk, rv    [L, B, Hkv, R, D] model dtype: entry j holds slot `flushed + j` while `flushed + j < fill`
  pos, valid [L, B, Hkv, C]; fill, flushed [L, B, Hkv] int32
  local     Gemma's sliding-window rolling buffers, kept in full precision (bounded by the window,
            never evicted or compacted)
Keys are stored rotated when the configuration rotates (`kv_quant.rotate`); the window is not.
"""

from __future__ import annotations

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


@struct.dataclass
class QuantizedKVCache:
    k: Quantized
    v: Quantized
    rk: jax.Array
    rv: jax.Array
    pos: jax.Array
    valid: jax.Array
    fill: jax.Array
    flushed: jax.Array
    local: KVCache | None = None
    config: KVQuant = struct.field(pytree_node=False, default=KVQuant())

    stacked = True

    @property
    def capacity(self) -> int:
        return self.pos.shape[3]

    @property
    def window(self) -> int:
        return self.rk.shape[3]

    def write_slots(self, n: int) -> jax.Array:
        """[L, B, Hkv, 1]: each head's next write slot (decode appends one token per step)."""
        if n != 1:
            raise ValueError("a QuantizedKVCache is written one decode token at a time (n = 1)")
        return self.fill[..., None]

    def check_model(self, cfg: Any) -> None:
        if self.pos.shape[0] != cfg.num_global_layers or bool(cfg.local_layer_ids) != (self.local is not None):
            raise ValueError(f"quantized cache: {self.pos.shape[0]} layers and local buffers: {self.local is not None}; "
                             f"this {cfg.family} model needs {cfg.num_global_layers} global layers and local "
                             f"buffers: {bool(cfg.local_layer_ids)}")

    def layer_keys(self, l: Any) -> QuantizedKeys:
        """Layer `l`'s key set: the quantized slots (those below `flushed`) and the window."""
        flushed, fill = self.flushed[l], self.fill[l]
        slot = jnp.arange(self.capacity)
        pos = jnp.where(self.valid[l] & (slot < flushed[..., None]), self.pos[l], -1)
        rslot = flushed[..., None] + jnp.arange(self.window)  # [B,Hkv,R]
        inside = rslot < fill[..., None]
        at = jnp.minimum(rslot, self.capacity - 1)
        rpos = jnp.where(inside & jnp.take_along_axis(self.valid[l], at, axis=-1),
                         jnp.take_along_axis(self.pos[l], at, axis=-1), -1)
        take = lambda q: jax.tree.map(lambda a: a[l], q)  # noqa: E731
        return QuantizedKeys(k=take(self.k), v=take(self.v), pos=pos, rk=self.rk[l], rv=self.rv[l], rpos=rpos,
                             rslot=jnp.where(inside, rslot, -1), config=self.config)

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
        write = jnp.broadcast_to((p >= 0)[:, None], self.fill.shape[1:])  # [B,Hkv]
        fill, flushed = self.fill[l], self.flushed[l]
        j = jnp.where(write, fill - flushed, self.window)  # out of range: dropped
        B, H = write.shape
        bi, hi = jnp.arange(B)[:, None], jnp.arange(H)[None, :]
        slot = jnp.where(write, fill, self.capacity)
        cache = self.replace(
            rk=self.rk.at[l, bi, hi, j].set(k[:, :, 0].astype(self.rk.dtype), mode="drop"),
            rv=self.rv.at[l, bi, hi, j].set(v[:, :, 0].astype(self.rv.dtype), mode="drop"),
            pos=self.pos.at[l, bi, hi, slot].set(jnp.broadcast_to(p[:, None], (B, H)), mode="drop"),
            valid=self.valid.at[l, bi, hi, slot].set(True, mode="drop"),
            fill=self.fill.at[l].set(fill + write.astype(jnp.int32)))
        full = cache.fill[l] - flushed >= max(self.config.residual, 1)
        return jax.lax.cond(jnp.any(full), lambda c: c._flush(l, full), lambda c: c, cache)

    def _flush(self, l: Any, full: jax.Array) -> QuantizedKVCache:
        """Quantizes the window of the heads `full` [B,Hkv] into its slots [flushed, flushed + R)."""
        R, cfg = self.window, self.config
        flushed = self.flushed[l]
        inside = (flushed[..., None] + jnp.arange(R)) < self.fill[l][..., None]
        qk = kv_quant.quantize(kv_quant.rotate(self.rk[l], cfg), cfg, per_channel=cfg.key_axis == "channel",
                               valid=inside)
        qv = kv_quant.quantize(kv_quant.rotate(self.rv[l], cfg), cfg, valid=inside)
        per_group = cfg.slot_group if cfg.key_axis == "channel" else 1
        k = _put(self.k, l, qk, flushed, full, per_group)
        v = _put(self.v, l, qv, flushed, full, 1)
        return self.replace(k=k, v=v, flushed=self.flushed.at[l].set(jnp.where(full, flushed + R, flushed)))

    def evict(self, keep: jax.Array) -> QuantizedKVCache:
        """Clears the valid bit (and position) of every slot where `keep [L,B,Hkv,C]` is False."""
        valid = self.valid & keep
        return self.replace(valid=valid, pos=jnp.where(valid, self.pos, -1))

    def num_valid(self) -> jax.Array:
        return self.valid.sum(-1)

    def row_entries(self) -> jax.Array:
        return self.valid.sum(axis=(0, 2, 3)).astype(jnp.float32)

    def row_kv_bytes(self, itemsize: int = 2) -> jax.Array:
        """Key and value bytes of the entries each row holds, [B] float32: a quantized entry's codes, scales
        and zero points (per-channel key scales shared by their slot group), a window entry's full
        precision at `itemsize` bytes per element (2: a 16-bit cache's)."""
        slots = self.k.codes.shape[:4]
        per_entry = (kv_quant.nbytes(self.k) + kv_quant.nbytes(self.v)) / (slots[0] * slots[1] * slots[2] * slots[3])
        below = self.valid & (jnp.arange(self.capacity) < self.flushed[..., None])
        quantized = below.sum(axis=(0, 2, 3)).astype(jnp.float32)
        window = self.row_entries() - quantized
        return quantized * per_entry + window * (2 * self.rk.shape[-1] * itemsize)

    def kv_nbytes(self) -> int:
        """Bytes of keys and values: codes, scales, zero points and the full-precision window."""
        return kv_quant.nbytes(self.k) + kv_quant.nbytes(self.v) + int(self.rk.nbytes) + int(self.rv.nbytes)

    def nbytes(self) -> int:
        """Bytes of every buffer: keys and values (`kv_nbytes`), positions, valid bits, the write
        pointers and Gemma's rolling buffers."""
        meta = sum(int(a.nbytes) for a in (self.pos, self.valid, self.fill, self.flushed))
        return self.kv_nbytes() + meta + (0 if self.local is None else self.local.nbytes())

    def shardings(self, mesh: Mesh) -> QuantizedKVCache:
        """Rows over "data", KV heads over "model" (where they divide), for every per-head array."""
        spec = lambda a: logical_sharding(("layers", "batch", "kv_heads") + (None,) * (a.ndim - 3), a.shape,  # noqa: E731
                                          mesh)
        local = None if self.local is None else self.local.shardings(mesh)
        return jax.tree.map(spec, self.replace(local=None)).replace(local=local)


def _put(store: Quantized, l: Any, new: Quantized, start: jax.Array, heads: jax.Array, per_group: int) -> Quantized:
    """`new` (quantized rows [B,Hkv,R,...]) written into layer l of `store` at rows start .. start+R of the
    `heads` [B,Hkv] where True; scales per group of `per_group` rows go to row start / per_group."""
    B, H = heads.shape

    def one(buf: jax.Array, rows: jax.Array, per: int) -> jax.Array:
        n = rows.shape[2]
        idx = jnp.where(heads[..., None], start[..., None] // per + jnp.arange(n), buf.shape[3])
        return buf.at[l, jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], idx].set(
            rows.astype(buf.dtype), mode="drop")

    return Quantized(codes=one(store.codes, new.codes, 1), scale=one(store.scale, new.scale, per_group),
                     zero=None if store.zero is None else one(store.zero, new.zero, per_group))


def from_cache(cache: KVCache, config: KVQuant) -> QuantizedKVCache:
    """The entries of a (compressed) dense cache, quantized (traceable; config static).

    Each head's write pointer is one past its last valid slot. Per-token scales: every kept entry is
    quantized. Per-channel keys: the whole groups of G slots below the pointer are quantized and the
    remainder starts the full-precision window."""
    L, B, H, C, D = cache.k.shape
    config.check(D)
    slot = jnp.arange(C)
    fill = jnp.max(jnp.where(cache.valid, slot + 1, 0), axis=-1).astype(jnp.int32)
    channel = config.key_axis == "channel"
    G = config.slot_group if channel else 1
    flushed = (fill // G) * G
    Cp = -(-C // G) * G
    R = max(config.residual, 1)
    pad = lambda a: jnp.pad(a, ((0, 0),) * 3 + ((0, Cp - C), (0, 0)))  # noqa: E731
    k, v = pad(kv_quant.rotate(cache.k, config)), pad(kv_quant.rotate(cache.v, config))
    below = jnp.pad(cache.valid & (slot < flushed[..., None]), ((0, 0),) * 3 + ((0, Cp - C),))
    qk = kv_quant.quantize(k, config, per_channel=channel, valid=below)
    qv = kv_quant.quantize(v, config, valid=below)
    src = flushed[..., None] + jnp.arange(R)  # window entry j <- slot flushed + j (if below fill)
    inside = src < fill[..., None]
    gather = lambda a: jnp.where(inside[..., None], jnp.take_along_axis(  # noqa: E731
        a, jnp.minimum(src, C - 1)[..., None], axis=3), jnp.zeros((), a.dtype))
    return QuantizedKVCache(k=qk, v=qv, rk=gather(cache.k), rv=gather(cache.v), pos=cache.pos, valid=cache.valid,
                            fill=fill, flushed=flushed, local=cache.local, config=config)
