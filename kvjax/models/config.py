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
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# HF `model_type` values that name a family differently (used when `architectures` is absent)
_MODEL_TYPES = {"gemma3_text": "gemma3"}
GEMMA_FAMILIES = ("gemma2", "gemma3")
# Gemma variants that are refused with a pointer to what is supported
_UNSUPPORTED_GEMMA = {
    "Gemma3ForConditionalGeneration": "multimodal Gemma 3 (vision tower + text); kvjax runs the text-only "
                                      "Gemma3ForCausalLM checkpoints (e.g. google/gemma-3-1b-it)",
    "GemmaForCausalLM": "Gemma 1; kvjax runs Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM)",
    "Gemma3nForConditionalGeneration": "Gemma 3n; kvjax runs Gemma 2 and Gemma 3 text (Gemma3ForCausalLM)",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
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
    # the window of the layers `layer_types` marks "sliding_attention" (Gemma: rolling buffers, see
    # kvjax.models.local); with no layer_types (Mistral) it would apply to every layer: not implemented,
    # so sequences longer than it are refused
    sliding_window: int | None = None
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Gemma 2 / Gemma 3 (all default to the Llama behaviour):
    hidden_act: str = "silu"  # MLP gate activation: "silu" or "gelu_pytorch_tanh"
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (default head_dim ** -0.5)
    attn_logit_softcapping: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_logit_softcapping: float | None = None  # output logits -> cap * tanh(logits / cap)
    layer_types: tuple[str, ...] = ()  # per layer, "full_attention" or "sliding_attention"; () = all full
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), default RoPE; None = as global

    @property
    def gemma(self) -> bool:
        """Gemma conventions: embeddings scaled by sqrt(hidden), RMSNorm with (1 + weight) in float32,
        norms before and after both the attention and the MLP."""
        return self.family in GEMMA_FAMILIES

    @property
    def attn_scale(self) -> float:
        """The softmax scale of the attention logits."""
        return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def local_layer_ids(self) -> tuple[int, ...]:
        """Layers attending over a sliding window (rolling buffers, never evicted by a policy)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

    @property
    def global_layer_ids(self) -> tuple[int, ...]:
        """Layers attending over the whole cache: the layers of the `KVCache` that policies compress."""
        local = set(self.local_layer_ids)
        return tuple(i for i in range(self.num_layers) if i not in local)

    @property
    def num_global_layers(self) -> int:
        """Layers of the policy-visible `KVCache` (`num_layers` for Llama-family models)."""
        return len(self.global_layer_ids)

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
        for a in archs:
            if family is None and a in _UNSUPPORTED_GEMMA:
                raise ValueError(f"unsupported architecture {a!r}: {_UNSUPPORTED_GEMMA[a]}")
        if family is None:
            model_type = hf.get("model_type")
            by_type = {**{v: v for v in SUPPORTED_ARCHITECTURES.values()}, **_MODEL_TYPES}
            if not archs and model_type == "gemma3":  # HF's model_type of the text-only Gemma 3 is gemma3_text
                raise ValueError(f"unsupported model_type 'gemma3': {_UNSUPPORTED_GEMMA['Gemma3ForConditionalGeneration']}")
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
        if family == "mistral" or family in GEMMA_FAMILIES or hf.get("use_sliding_window"):
            sliding = hf.get("sliding_window")
        fields = dict(
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
            qk_norm=family in ("qwen3", "gemma3"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=sliding,
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
            **rope,
        )
        if family in GEMMA_FAMILIES:
            fields.update(_gemma_fields(hf, family))
        return cls(**fields)

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
    if scaling and "full_attention" in scaling:  # transformers >= 5, per layer type (Gemma 3): the global layers
        scaling = scaling["full_attention"]
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


def _gemma_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 fields of a HF config (HF's defaults where a field is absent)."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an embedding Gemma) is not supported: kvjax runs "
                         "causal decoders")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    act = {"gelu_tanh": "gelu_pytorch_tanh"}.get(act, act)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={act!r} is not supported for {family}; accepted values: "
                         "['gelu_pytorch_tanh']")
    L = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:  # configs older than layer_types: HF's default patterns
        period = 2 if family == "gemma2" else int(hf.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(L)]
    if len(layer_types) != L or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types={layer_types!r} must list one of {list(LAYER_TYPES)} for each of the "
                         f"{L} layers")
    if "sliding_attention" in layer_types and not hf.get("sliding_window"):
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    fields: dict[str, Any] = {
        "hidden_act": act,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0 if family == "gemma2" else None),
        "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0 if family == "gemma2" else None),
        "layer_types": tuple(layer_types),
        "sliding_window": hf["sliding_window"] if "sliding_attention" in layer_types else None,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }
    if family == "gemma3":
        params = hf.get("rope_parameters") or {}
        local = params.get("sliding_attention") if "sliding_attention" in params else None
        if local is not None:
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"rope_type {local.get('rope_type')!r} of the sliding layers is not supported; "
                                 "accepted values: ['default']")
            fields["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
        else:
            fields["rope_local_theta"] = float(hf.get("rope_local_base_freq", 10000.0))
        if "rope_theta" not in hf and "rope_theta" not in params.get("full_attention", {}):
            fields["rope_theta"] = 1_000_000.0  # HF's Gemma 3 global default
    return fields
