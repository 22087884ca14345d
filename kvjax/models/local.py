"""Sliding-window ("local") layers of Gemma 2 / Gemma 3: their place in the layer stack and their
rolling buffers.

A local layer attends only to keys at positions q - W < p <= q (HF's `sliding_window_overlay`:
`kv_idx > q_idx - sliding_window`, the same for Gemma 2 and Gemma 3), so it needs no eviction:
its cache is a rolling buffer of W = `cfg.sliding_window` slots per (row, KV head), slot `p mod W`
holding position p. Writing a chunk keeps, per row, its last W real tokens (distinct positions
mod W, so the scatter has no collisions); a chunk longer than W first attends over the buffer and
its own keys, then writes. The buffers live in `KVCache.local`; policies see only the global layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache
from kvjax.models.config import ModelConfig


def layer_plan(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per layer `[L]`: whether it is a local layer (bool), and its index among the layers of its kind
    (into the global `KVCache` or into `KVCache.local`)."""
    is_local = np.zeros(cfg.num_layers, bool)
    is_local[list(cfg.local_layer_ids)] = True
    index = np.zeros(cfg.num_layers, np.int32)
    index[list(cfg.global_layer_ids)] = np.arange(cfg.num_global_layers)
    index[list(cfg.local_layer_ids)] = np.arange(len(cfg.local_layer_ids))
    return is_local, index


def init_cache(cfg: ModelConfig, batch: int, capacity: int) -> KVCache:
    """An empty cache for `cfg`: `capacity` slots per head on each global layer, and (for models with
    sliding-window layers) a rolling buffer of `sliding_window` slots per head on each local layer."""
    cache = KVCache.init(cfg.num_global_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim, cfg.jnp_dtype)
    if not cfg.local_layer_ids:
        return cache
    local = KVCache.init(len(cfg.local_layer_ids), batch, cfg.num_kv_heads, cfg.sliding_window, cfg.head_dim,
                         cfg.jnp_dtype)
    return cache.replace(local=local)


def rolling_write(buffers: KVCache, layer: jax.Array | int, k: jax.Array, v: jax.Array, positions: jax.Array
                  ) -> KVCache:
    """Writes a chunk into the rolling buffer of local layer `layer`.

    buffers: the rolling buffers (`KVCache.local`: k, v [Ll,B,Hkv,W,D], pos, valid [Ll,B,Hkv,W]); k, v
    [B,Hkv,n,D] new keys (post-RoPE) and values; positions [B,n] (-1 = padding, not written). Per row,
    the tokens within W of the row's last position are written at slot `pos mod W` (their positions are
    distinct, hence so are their slots); older ones are not. Only those entries are touched (a scatter;
    all -1 writes nothing).
    """
    _, B, H, W = buffers.pos.shape
    last = jnp.max(positions, axis=-1, keepdims=True)
    write = (positions >= 0) & (positions > last - W)
    slot = jnp.where(write, positions % W, W)  # W is out of bounds: dropped
    idx = (layer, jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], slot[:, None, :])
    pos = jnp.broadcast_to(positions[:, None, :], (B, H, positions.shape[1])).astype(jnp.int32)
    return buffers.replace(k=buffers.k.at[idx].set(k.astype(buffers.k.dtype), mode="drop"),
                           v=buffers.v.at[idx].set(v.astype(buffers.v.dtype), mode="drop"),
                           pos=buffers.pos.at[idx].set(pos, mode="drop"),
                           valid=buffers.valid.at[idx].set(True, mode="drop"))
