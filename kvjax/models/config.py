"""Model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp

# HF `architectures` / `model_type` values this package implements, mapped to a family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyperparameters of a Llama-family decoder (hashable: usable as a jit static argument)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size G)."""
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self) -> Any:
        return SUPPORTED_DTYPES[self.dtype]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        """Builds a config from the dict of a HF `config.json`; refuses unsupported architectures by name."""
        archs = hf.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            model_type = hf.get("model_type")
            by_type = {v: v for v in SUPPORTED_ARCHITECTURES.values()}
            if not archs and model_type in by_type:
                family = by_type[model_type]
            else:
                raise ValueError(
                    f"unsupported architecture {archs or model_type!r}: kvjax supports "
                    f"{sorted(SUPPORTED_ARCHITECTURES)}"
                )
        dtype = dtype or _dtype_name(hf.get("torch_dtype") or hf.get("dtype") or "float32")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; accepted values: {sorted(SUPPORTED_DTYPES)}")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        rope = _rope_fields(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        sliding = None
        if family == "mistral" or hf.get("use_sliding_window"):
            sliding = hf.get("sliding_window")
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=sliding,
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
            **rope,
        )

    @classmethod
    def from_file(cls, path: str | pathlib.Path, dtype: str | None = None) -> "ModelConfig":
        path = pathlib.Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"model config not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"corrupt model config {path}: {e}") from None
        return cls.from_hf(hf, dtype)


def _dtype_name(torch_dtype: str) -> str:
    name = str(torch_dtype).removeprefix("torch.")
    return {"float": "float32", "bf16": "bfloat16", "float16": "bfloat16", "half": "bfloat16"}.get(name, name)


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"rope_theta": float(hf.get("rope_theta", 10000.0))}
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return fields
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if "rope_theta" in scaling:  # transformers >= 5 nests theta in rope_parameters
        fields["rope_theta"] = float(scaling["rope_theta"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; accepted values: {list(SUPPORTED_ROPE_TYPES)}")
    fields["rope_type"] = rope_type
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(scaling["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(scaling["high_freq_factor"])
        fields["rope_original_max_position"] = int(scaling["original_max_position_embeddings"])
    return fields
