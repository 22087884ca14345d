"""Random initialisation and export to a Hugging Face checkpoint folder (config.json + safetensors)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ModelConfig
from kvjax.models.loading import _LAYER_TENSORS, hf_name, param_shapes

_NORMS = ("input_norm", "post_norm", "q_norm", "k_norm", "final_norm")


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict[str, Any]:
    """Normal(0, std) weights, zero biases, unit norms (the HF Llama initialisation), in float32."""
    shapes = param_shapes(cfg)
    flat = {k: v for k, v in shapes.items() if k != "layers"}
    flat.update({f"layers.{k}": v for k, v in shapes["layers"].items()})
    keys = dict(zip(sorted(flat), jax.random.split(key, len(flat))))
    out: dict[str, Any] = {"layers": {}}
    for name, shape in flat.items():
        short = name.removeprefix("layers.")
        if short in _NORMS:
            x = jnp.ones(shape, jnp.float32)
        elif short.endswith("_bias"):
            x = jnp.zeros(shape, jnp.float32)
        else:
            x = std * jax.random.normal(keys[name], shape, jnp.float32)
        (out["layers"] if name.startswith("layers.") else out)[short] = x
    return out


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The `config.json` dict transformers reads back into the same model."""
    archs = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM"}
    if cfg.family not in archs:  # Gemma's norms, scales and layer types are not written out
        raise ValueError(f"exporting family={cfg.family!r} is not supported; accepted values: {sorted(archs)}")
    arch = archs[cfg.family]
    out = {
        "architectures": [arch],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": "silu",
        "torch_dtype": cfg.dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "pad_token_id": cfg.pad_token_id,
    }
    if cfg.rope_type != "default":
        out["rope_scaling"] = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
        if cfg.rope_type == "llama3":
            out["rope_scaling"].update(low_freq_factor=cfg.rope_low_freq_factor,
                                       high_freq_factor=cfg.rope_high_freq_factor,
                                       original_max_position_embeddings=cfg.rope_original_max_position)
    return out


def save_hf(folder: str | os.PathLike, params: dict[str, Any], cfg: ModelConfig) -> pathlib.Path:
    """Writes `config.json` and `model.safetensors` (in cfg.dtype) that `load_model` and transformers read."""
    from safetensors.flax import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = cfg.jnp_dtype
    tensors = {}
    for key in ("embed", "final_norm", "lm_head"):
        if key in params:
            x = np.asarray(params[key])
            tensors[hf_name(key)] = jnp.asarray(x.T if key == "lm_head" else x, dtype)
    for key, stacked in params["layers"].items():
        transpose = _LAYER_TENSORS[key][1]
        stacked = np.asarray(stacked)
        for i in range(cfg.num_layers):
            tensors[hf_name(key, i)] = jnp.asarray(stacked[i].T if transpose else stacked[i], dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return folder
