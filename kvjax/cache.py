"""The fixed-shape KV cache: a pytree of post-RoPE keys/values with positions and a valid mask.

Shapes (L layers, B rows, Hkv KV heads, C slots per head, D head dim):
  k, v   [L, B, Hkv, C, D]  model dtype, keys stored after RoPE at their original position
  pos    [L, B, Hkv, C]     int32 original absolute position of each slot, -1 where empty
  valid  [L, B, Hkv, C]     bool

Slot order carries no meaning (keys carry their rotation); attention masks by `valid` and by
position. New tokens take the first free slots of each (layer, row, head): `write_slots`.

The layout interface the forward pass uses (`kvjax.models.forward`), shared with `RaggedCache`:
`write_layer` (one layer's new entries), `layer_keys` (the key set attention reads,
`kvjax.kernels.attention.Keys`), `stacked` (layers run under `lax.scan`), `check_model`,
`num_valid` / `row_entries` (entries held), `nbytes`, and `shardings(mesh)`.

Models with sliding-window layers (Gemma 2 / 3) hold only their *global* layers in k, v, pos, valid
(L = `cfg.num_global_layers`): the cache that policies score, compact and evict. The sliding layers'
rolling buffers ride along in `local`, a nested KVCache `[L_local, B, Hkv, W, ...]` whose slot
`p mod W` holds position p (see kvjax.models.local). Every method here carries `local` unchanged:
policies never read or change it, and its size is bounded by the window W.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from kvjax.kernels.attention import Keys
from kvjax.sharding import logical_sharding

# logical axes of the cache arrays (k, v; pos and valid are the first four)
CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


@struct.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    pos: jax.Array
    valid: jax.Array
    local: "KVCache | None" = None

    stacked = True  # layers stacked on axis 0: the forward runs them under `lax.scan`

    @classmethod
    def init(cls, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: Any) -> "KVCache":
        """An empty cache (zeros, every slot invalid)."""
        shape = (num_layers, batch, num_kv_heads, capacity)
        return cls(
            k=jnp.zeros(shape + (head_dim,), dtype),
            v=jnp.zeros(shape + (head_dim,), dtype),
            pos=jnp.full(shape, -1, jnp.int32),
            valid=jnp.zeros(shape, jnp.bool_),
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def write_slots(self, n: int) -> jax.Array:
        """Per-head write slots `[L, B, Hkv, n]`: the first `n` free slots of each head, in slot order.

        The caller sizes the capacity so that `n` free slots exist (the engine checks this on the host).
        """
        if n == 1:  # the decode hot path: O(C) instead of a sort
            return jnp.argmin(self.valid, axis=-1)[..., None].astype(jnp.int32)
        return jnp.argsort(self.valid, axis=-1, stable=True)[..., :n].astype(jnp.int32)

    def append(self, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "KVCache":
        """Writes `n` new tokens into each head's first free slots.

        k_new, v_new: [L, B, Hkv, n, D]; pos_new: [B, n] int32 (-1 marks padding, written as invalid).
        """
        n = pos_new.shape[1]
        slots = self.write_slots(n)
        return self.scatter(slots, k_new, v_new, pos_new)

    def scatter(self, slots: jax.Array, k_new: jax.Array, v_new: jax.Array, pos_new: jax.Array) -> "KVCache":
        """Writes new entries at explicit `slots [L, B, Hkv, n]`; see `append`."""
        L, B, H, _ = slots.shape
        li, bi, hi = jnp.meshgrid(jnp.arange(L), jnp.arange(B), jnp.arange(H), indexing="ij")
        idx = (li[..., None], bi[..., None], hi[..., None], slots)
        pos = jnp.broadcast_to(pos_new[None, :, None, :], slots.shape).astype(jnp.int32)
        return self.replace(
            k=self.k.at[idx].set(k_new.astype(self.k.dtype)),
            v=self.v.at[idx].set(v_new.astype(self.v.dtype)),
            pos=self.pos.at[idx].set(pos),
            valid=self.valid.at[idx].set(pos >= 0),
        )

    def evict(self, keep: jax.Array) -> "KVCache":
        """Clears the valid bit (and position) of every slot where `keep [L, B, Hkv, C]` is False."""
        valid = self.valid & keep
        return self.replace(valid=valid, pos=jnp.where(valid, self.pos, -1))

    def grow(self, capacity: int) -> "KVCache":
        """The same entries in the same slots, with empty slots appended up to `capacity`."""
        extra = capacity - self.capacity
        if extra < 0:
            raise ValueError(f"grow: capacity={capacity} is below the current {self.capacity}")
        pad = [(0, 0)] * (self.pos.ndim - 1) + [(0, extra)]
        kv_pad = pad + [(0, 0)]
        return self.replace(k=jnp.pad(self.k, kv_pad), v=jnp.pad(self.v, kv_pad),
                            pos=jnp.pad(self.pos, pad, constant_values=-1), valid=jnp.pad(self.valid, pad))

    def compact(self, keep: jax.Array, capacity: int) -> tuple["KVCache", jax.Array]:
        """Gathers the kept, valid slots of each head into a new cache of `capacity` slots.

        Kept slots are placed first, sorted by position; the rest of the buffer is empty.
        Returns the new cache and `src [L, B, Hkv, capacity]`, the source slot of each new slot
        (-1 where empty), so that per-slot policy state can follow (`gather_slots`).
        Raises if some head keeps more than `capacity` slots (checked only outside jit).
        """
        keep = keep & self.valid
        src = kept_sources(keep, self.pos, capacity)
        n_keep = keep.sum(-1)
        filled = jnp.arange(capacity) < n_keep[..., None]
        if not isinstance(n_keep, jax.core.Tracer) and int(n_keep.max(initial=0)) > capacity:
            raise ValueError(f"compact: a head keeps {int(n_keep.max())} slots, more than capacity={capacity}")
        src = jnp.where(filled, src, -1)
        new = KVCache(
            k=gather_slots(self.k, src),
            v=gather_slots(self.v, src),
            pos=jnp.where(filled, gather_slots(self.pos, src), -1),
            valid=filled,
            local=self.local,
        )
        return new, src

    def num_valid(self) -> jax.Array:
        """Entries in use per (layer, row, head) `[L, B, Hkv]`."""
        return self.valid.sum(-1)

    def row_entries(self) -> jax.Array:
        """Entries per row, summed over layers and heads: [B] float32."""
        return self.valid.sum(axis=(0, 2, 3)).astype(jnp.float32)

    def row_kv_bytes(self, itemsize: int = 2) -> jax.Array:
        """Key and value bytes of the entries each row holds, [B] float32, at `itemsize` bytes per element
        (2: what a 16-bit cache holds, whatever dtype runs)."""
        return self.row_entries() * (2 * self.k.shape[-1] * itemsize)

    def check_model(self, cfg: Any) -> None:
        """ValueError unless this cache fits the model `cfg` (its global layers; rolling buffers for
        models with sliding-window layers)."""
        has_local = bool(cfg.local_layer_ids)
        if self.k.shape[0] != cfg.num_global_layers or has_local != (self.local is not None):
            raise ValueError(f"extend: the cache has {self.k.shape[0]} layers and local buffers: "
                             f"{self.local is not None}; this {cfg.family} model needs {cfg.num_global_layers} "
                             f"global layers and local buffers: {has_local} (build it with "
                             "kvjax.models.local.init_cache)")

    def layer_keys(self, l: Any) -> Keys:
        """What attention reads in layer `l`: keys, values [B,Hkv,C,D] and positions (-1 = empty)."""
        return Keys(k=self.k[l], v=self.v[l], pos=jnp.where(self.valid[l], self.pos[l], -1))

    def write_layer(self, l: Any, k: jax.Array, v: jax.Array, positions: jax.Array, slots: jax.Array | None = None,
                    enabled: jax.Array | None = None) -> "KVCache":
        """Writes one layer's new entries: k, v [B,Hkv,n,D] at positions [B,n] (-1 = padding, written
        invalid) into layer `l`'s `slots` [B,Hkv,n], or, with slots=None, into slots 0..n-1 (a prefill into
        an empty cache). enabled (a traced bool): False drops the write (models whose sliding-window
        layers share the layer scan)."""
        B, Hkv, n = k.shape[:3]
        new_pos = jnp.broadcast_to(positions[:, None, :], (B, Hkv, n)).astype(jnp.int32)
        if slots is None and enabled is None:
            put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[None].astype(buf.dtype),  # noqa: E731
                                                              (l,) + (0,) * (buf.ndim - 1))
            return self.replace(k=put(self.k, k), v=put(self.v, v), pos=put(self.pos, new_pos),
                                valid=put(self.valid, new_pos >= 0))
        if slots is None:
            slots = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, Hkv, n))
        mode = None
        if enabled is not None:  # an out-of-range slot drops the write
            slots, mode = jnp.where(enabled, slots, self.capacity), "drop"
        bi, hi = jnp.meshgrid(jnp.arange(B), jnp.arange(Hkv), indexing="ij")
        idx = (l, bi[..., None], hi[..., None], slots)
        return self.replace(k=self.k.at[idx].set(k.astype(self.k.dtype), mode=mode),
                            v=self.v.at[idx].set(v.astype(self.v.dtype), mode=mode),
                            pos=self.pos.at[idx].set(new_pos, mode=mode),
                            valid=self.valid.at[idx].set(new_pos >= 0, mode=mode))

    def shardings(self, mesh: Mesh) -> "KVCache":
        """The cache's layout over `mesh`: rows over "data", KV heads over "model" (where they divide)."""
        full = logical_sharding(CACHE_AXES, self.k.shape, mesh)
        meta = logical_sharding(CACHE_AXES[:4], self.pos.shape, mesh)
        local = None if self.local is None else self.local.shardings(mesh)
        return KVCache(k=full, v=full, pos=meta, valid=meta, local=local)

    def nbytes(self) -> int:
        """Bytes of the allocated buffers (k, v, pos, valid, and the local rolling buffers): what the
        cache really occupies."""
        own = sum(int(x.size) * x.dtype.itemsize for x in (self.k, self.v, self.pos, self.valid))
        return own + (0 if self.local is None else self.local.nbytes())

    def nbytes_in_use(self) -> int:
        """Bytes of keys and values in valid slots (the logical size of what is kept)."""
        per_entry = 2 * self.k.shape[-1] * self.k.dtype.itemsize
        own = int(jax.device_get(self.valid.sum())) * per_entry
        return own + (0 if self.local is None else self.local.nbytes_in_use())


SOURCE_ORDERS = ("count", "sort")


def kept_sources(keep: jax.Array, pos: jax.Array, capacity: int, by: str | None = None) -> jax.Array:
    """The slots of the kept entries in position order, `[..., capacity]` int32 from keep, pos `[..., C]`
    (past the kept count: any slot; `compact` masks them).

    by="sort": a stable argsort of the positions. by="count": where the kept positions already ascend
    along the slots (a prefill's cache, a compacted one and its appended tokens; not one whose freed slots
    took later positions), kept slot s goes to place cumsum(keep)[s] - 1, a scatter (on CPU ~10x cheaper
    than the sort); a `lax.cond` falls back to the sort when they do not. None: the sort on TPUs, where
    scatters serialise, else "count".
    """
    if by is None:
        by = "sort" if jax.default_backend() == "tpu" else "count"
    if by not in SOURCE_ORDERS:
        raise ValueError(f"kept_sources: by={by!r}; accepted values: {SOURCE_ORDERS} or None")
    C = keep.shape[-1]

    def by_sort() -> jax.Array:
        order = jnp.argsort(jnp.where(keep, pos, jnp.iinfo(jnp.int32).max), axis=-1, stable=True)
        if C < capacity:
            order = jnp.concatenate([order, jnp.zeros(order.shape[:-1] + (capacity - C,), order.dtype)], axis=-1)
        return order[..., :capacity].astype(jnp.int32)

    def by_count() -> jax.Array:
        place = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1, capacity)  # capacity: dropped
        lead = tuple(jax.lax.broadcasted_iota(jnp.int32, keep.shape, d) for d in range(keep.ndim - 1))
        slot = jax.lax.broadcasted_iota(jnp.int32, keep.shape, keep.ndim - 1)
        return jnp.zeros(keep.shape[:-1] + (capacity,), jnp.int32).at[(*lead, place)].set(slot, mode="drop")

    if by == "sort":
        return by_sort()
    kept_pos = jnp.where(keep, pos, -1)
    before = jnp.concatenate([jnp.full(kept_pos.shape[:-1] + (1,), -1, kept_pos.dtype),
                              jax.lax.cummax(kept_pos, axis=kept_pos.ndim - 1)[..., :-1]], axis=-1)
    return jax.lax.cond(jnp.all(~keep | (pos > before)), by_count, by_sort)


def gather_slots(x: jax.Array, src: jax.Array) -> jax.Array:
    """Gathers per-slot data `x [L, B, Hkv, C, ...]` at `src [L, B, Hkv, C']` (-1 reads slot 0; mask it)."""
    idx = jnp.maximum(src, 0)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - idx.ndim))
    return jnp.take_along_axis(x, idx, axis=3)
