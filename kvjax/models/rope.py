"""Rotary position embeddings in HF's half-split ("rotate_half") layout, with llama3 / linear scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies `[D/2]` (float32), scaled as the checkpoint's rope_type says."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    if cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def local_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[D/2]` of the sliding-window layers: default RoPE at `rope_local_theta`
    (Gemma 3), or those of the global layers when the config has none."""
    if cfg.rope_local_theta is None:
        return inverse_frequencies(cfg)
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_local_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    return inv.astype(np.float32)


def rope_tables(positions: jnp.ndarray, inv_freq: np.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin of shape `positions.shape + [D]`, computed in float32 and cast to `dtype` (as HF does)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates `x [B,H,T,D]` with tables `[B,T,D]` (broadcast over heads) or `[B,H,T,D]`."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    if cos.ndim == x.ndim - 1:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotated * sin


def slot_ranks(valid: jnp.ndarray, pos: jnp.ndarray) -> jnp.ndarray:
    """Rank of each valid slot among the valid slots of its head, by position: `[..., C]` int32
    (invalid slots get ranks past the valid ones). StreamingLLM's cache-relative positions."""
    key = jnp.where(valid, pos, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1).astype(jnp.int32)
