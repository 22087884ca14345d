"""One decode step of the Llama-family model over a `RaggedCache` (per-layer storage of its own size).

The layers' caches differ in shape, so they cannot ride the stacked `lax.scan` of `extend`: the step
runs the layers one after another (unrolled), each with the model's own layer pieces
(`layer_qkv`, `layer_finish`), writing the token's key/value at each head's next slot and attending
over what the layer stores: `kernels.decode_attention` for a dense layer, the segmented decode
attention for a segmented one. Original RoPE only; no observations (no decode-time eviction) and no
sliding-window layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import kernels
from kvjax.cache_ragged import RaggedCache, append_token
from kvjax.kernels.segment_attention import segment_decode_attention
from kvjax.models.config import ModelConfig
from kvjax.models.llama import Params, embed_tokens, layer_finish, layer_qkv, output_logits
from kvjax.models.rope import apply_rope, inverse_frequencies, rope_tables


def split_layers(params: Params) -> list[Params]:
    """params["layers"] as one params pytree per layer (slice once, outside a decode loop)."""
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    return [jax.tree.map(lambda a, l=l: a[l], params["layers"]) for l in range(n)]


def decode_step(params: Params, cfg: ModelConfig, cache: RaggedCache, tokens: jax.Array, positions: jax.Array,
                layer_params: list[Params] | None = None) -> tuple[jax.Array, RaggedCache]:
    """tokens [B] at positions [B] (-1: a padding row, which writes nothing and sees nothing).
    layer_params: `split_layers(params)`, when the caller has sliced them already.
    Returns logits [B, V] float32 and the cache with the tokens appended."""
    if cfg.local_layer_ids or cfg.attn_logit_softcapping is not None:
        raise ValueError("ragged decode: models with sliding-window layers or attention soft-caps are not supported")
    if len(cache.layers) != cfg.num_layers:
        raise ValueError(f"ragged decode: the cache has {len(cache.layers)} layers, the model {cfg.num_layers}")
    Hkv = cfg.num_kv_heads
    cos, sin = rope_tables(jnp.maximum(positions, 0)[:, None], inverse_frequencies(cfg), cfg.jnp_dtype)
    h = embed_tokens(params, cfg, tokens[:, None])  # [B, 1, E]
    real = positions >= 0
    layers = []
    layer_params = split_layers(params) if layer_params is None else layer_params
    for lp, layer in zip(layer_params, cache.layers):
        q, k, v = layer_qkv(cfg, lp, h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        layer = append_token(layer, k[:, :, 0], v[:, :, 0], positions)
        if layer.kind == "dense":
            visible = (layer.pos >= 0) & real[:, None, None]
            out, _ = kernels.decode_attention(q[:, :, 0], layer.k, layer.v, visible, scale=cfg.attn_scale)
        else:
            seg = jnp.where((layer.pos >= 0) & real[:, None], layer.seg, -1)
            out = segment_decode_attention(q[:, :, 0], layer.k, layer.v, seg, num_kv_heads=Hkv, scale=cfg.attn_scale)
        h = layer_finish(cfg, lp, h, out[:, :, None])
        layers.append(layer)
    return output_logits(params, cfg, h)[:, 0], RaggedCache(layers=tuple(layers))
