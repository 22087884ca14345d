"""Loading Hugging Face checkpoints (safetensors, single or sharded) into the stacked params pytree."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from kvjax.models.config import ModelConfig
from kvjax.sharding import logical_sharding

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

# kvjax layer param -> (HF suffix under model.layers.{i}., transpose)
_LAYER_TENSORS = {
    "input_norm": ("input_layernorm.weight", False),
    "post_norm": ("post_attention_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True),
    "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True),
    "o": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "gate": ("mlp.gate_proj.weight", True),
    "up": ("mlp.up_proj.weight", True),
    "down": ("mlp.down_proj.weight", True),
    "gate_bias": ("mlp.gate_proj.bias", False),
    "up_bias": ("mlp.up_proj.bias", False),
    "down_bias": ("mlp.down_proj.bias", False),
}
# Gemma's four norms per layer: "post_norm" keeps its kvjax meaning (the norm before the MLP), and the
# outputs of the attention and of the MLP are normalised before their residual add
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_norm": ("pre_feedforward_layernorm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}


def layer_tensors(cfg: ModelConfig | None = None) -> dict[str, tuple[str, bool]]:
    """kvjax layer param -> (HF suffix under model.layers.{i}., transpose), for the config's family."""
    return _GEMMA_LAYER_TENSORS if cfg is not None and cfg.gemma else _LAYER_TENSORS


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Expected shapes of every param (kvjax layout), derived from the config alone."""
    E, F, D, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
    layers = {
        "input_norm": (L, E),
        "post_norm": (L, E),
        "q": (L, E, Hq * D),
        "k": (L, E, Hkv * D),
        "v": (L, E, Hkv * D),
        "o": (L, Hq * D, E),
        "gate": (L, E, F),
        "up": (L, E, F),
        "down": (L, F, E),
    }
    if cfg.qkv_bias:
        layers.update(q_bias=(L, Hq * D), k_bias=(L, Hkv * D), v_bias=(L, Hkv * D))
    if cfg.o_bias:
        layers["o_bias"] = (L, E)
    if cfg.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    if cfg.mlp_bias:
        layers.update(gate_bias=(L, F), up_bias=(L, F), down_bias=(L, E))
    if cfg.gemma:
        layers.update(post_attn_norm=(L, E), post_mlp_norm=(L, E))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "final_norm": (E,), "layers": layers}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    return shapes


# logical axes of every param (kvjax layout, layers stacked on a leading "layers" axis); kvjax.sharding's
# rules map them to mesh axes
_LAYER_AXES = {
    "input_norm": ("layers", "embed"),
    "post_norm": ("layers", "embed"),
    "post_attn_norm": ("layers", "embed"),
    "post_mlp_norm": ("layers", "embed"),
    "q": ("layers", "embed", "heads"),
    "k": ("layers", "embed", "kv_heads"),
    "v": ("layers", "embed", "kv_heads"),
    "o": ("layers", "heads", "embed"),
    "q_bias": ("layers", "heads"),
    "k_bias": ("layers", "kv_heads"),
    "v_bias": ("layers", "kv_heads"),
    "o_bias": ("layers", "embed"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "gate": ("layers", "embed", "mlp"),
    "up": ("layers", "embed", "mlp"),
    "down": ("layers", "mlp", "embed"),
    "gate_bias": ("layers", "mlp"),
    "up_bias": ("layers", "mlp"),
    "down_bias": ("layers", "embed"),
}


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """The `NamedSharding` of every param on `mesh` (the pytree of `param_shapes`): each param's logical
    axes mapped by kvjax.sharding's rules (heads, KV heads, MLP and vocabulary over "model")."""
    shapes = param_shapes(cfg)
    units = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}
    out = {
        "embed": logical_sharding(("vocab", "embed"), shapes["embed"], mesh),
        "final_norm": logical_sharding(("embed",), shapes["final_norm"], mesh),
        "layers": {k: logical_sharding(_LAYER_AXES[k], s, mesh, units) for k, s in shapes["layers"].items()},
    }
    if "lm_head" in shapes:
        out["lm_head"] = logical_sharding(("embed", "vocab"), shapes["lm_head"], mesh)
    return out


def hf_name(key: str, layer: int | None = None, cfg: ModelConfig | None = None) -> str:
    """The HF tensor name of a kvjax param (per layer for layer params; Gemma's norms need `cfg`)."""
    if layer is not None:
        return f"model.layers.{layer}.{layer_tensors(cfg)[key][0]}"
    return {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}[key]


class _TensorIndex:
    """Maps tensor names to the safetensors file holding them (single file or sharded index)."""

    def __init__(self, folder: pathlib.Path):
        index = folder / SAFETENSORS_INDEX
        single = folder / SAFETENSORS_SINGLE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"corrupt safetensors index {index}: {e!r}") from None
            self.files = {name: folder / f for name, f in weight_map.items()}
        elif single.exists():
            self.files = {name: single for name in _keys(single)}
        else:
            raise FileNotFoundError(
                f"no weights in {folder}: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} (safetensors)"
            )
        self._open: dict[pathlib.Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint")
        path = self.files[name]
        if path not in self._open:
            if not path.exists():
                raise FileNotFoundError(f"checkpoint shard {path} (listed in the index) is missing")
            try:
                self._open[path] = safe_open(str(path), framework="flax")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"corrupt safetensors file {path}: {e}") from None
        return np.asarray(self._open[path].get_tensor(name))


def _keys(path: pathlib.Path) -> list[str]:
    try:
        with safe_open(str(path), framework="flax") as f:
            return list(f.keys())
    except Exception as e:
        raise ValueError(f"corrupt safetensors file {path}: {e}") from None


def load_params(folder: str | os.PathLike, cfg: ModelConfig) -> dict[str, Any]:
    """Reads every tensor the config implies, checks its shape, and stacks layers `[L, ...]`.

    Returns host (NumPy) arrays in the config dtype; `jax.device_put` places them.
    """
    folder = pathlib.Path(folder)
    index = _TensorIndex(folder)
    shapes = param_shapes(cfg)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(np.float32)

    def read(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        x = index.get(name)
        want = shape[::-1] if transpose else shape
        if x.shape != tuple(want):
            raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, but the config implies {tuple(want)}")
        return (x.T if transpose else x).astype(dtype)

    params: dict[str, Any] = {
        "embed": read(hf_name("embed"), shapes["embed"], False),
        "final_norm": read(hf_name("final_norm"), shapes["final_norm"], False),
    }
    if not cfg.tie_embeddings:
        if hf_name("lm_head") in index:
            params["lm_head"] = read(hf_name("lm_head"), shapes["lm_head"], True)
        else:
            raise KeyError(f"tensor 'lm_head.weight' is missing and tie_word_embeddings is false in {folder}")
    layers = {}
    for key, shape in shapes["layers"].items():
        transpose = layer_tensors(cfg)[key][1]
        stacked = np.empty(shape, dtype)
        for i in range(cfg.num_layers):
            stacked[i] = read(hf_name(key, i, cfg), shape[1:], transpose)
        layers[key] = stacked
    params["layers"] = layers
    return params


def to_device(params: dict[str, Any], shardings: Any = None) -> dict[str, Any]:
    """Places host params on devices (optionally with a matching pytree of shardings)."""
    if shardings is None:
        return jax.tree.map(jnp.asarray, params)
    return jax.device_put(params, shardings)
