"""Loading GGUF files (llama.cpp's format) with the `gguf` package: config, dequantized weights, tokenizer.

The file is read with `gguf.GGUFReader` (a memory map) and each tensor is dequantized on its own with
`gguf.quants.dequantize`, cast to the requested dtype and written into the stacked `[L, ...]` params,
so at most one float32 tensor exists besides the result. llama.cpp stores the Q and K projection rows
of the `llama` architecture permuted for its interleaved RoPE; `unpermute_qk` undoes that to get the
Hugging Face (half-split RoPE) layout that `kvjax.models.llama` uses.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import gguf
import ml_dtypes
import numpy as np
from gguf import quants

from kvjax.models.config import ModelConfig
from kvjax.models.gguf_tokenizer import build_tokenizer
from kvjax.models.loading import param_shapes
from kvjax.models.rope import inverse_frequencies

# GGUF `general.architecture` -> the HF architecture kvjax implements it with
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# tensor types dequantized by gguf.quants (each checked against transformers' GGUF loader in the tests)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# kvjax layer param -> (GGUF tensor name under blk.{i}., transpose to [in, out])
_LAYER_TENSORS = {
    "input_norm": ("attn_norm.weight", False),
    "post_norm": ("ffn_norm.weight", False),
    "q": ("attn_q.weight", True),
    "k": ("attn_k.weight", True),
    "v": ("attn_v.weight", True),
    "o": ("attn_output.weight", True),
    "q_bias": ("attn_q.bias", False),
    "k_bias": ("attn_k.bias", False),
    "v_bias": ("attn_v.bias", False),
    "o_bias": ("attn_output.bias", False),
    "q_norm": ("attn_q_norm.weight", False),
    "k_norm": ("attn_k_norm.weight", False),
    "gate": ("ffn_gate.weight", True),
    "up": ("ffn_up.weight", True),
    "down": ("ffn_down.weight", True),
    "gate_bias": ("ffn_gate.bias", False),
    "up_bias": ("ffn_up.bias", False),
    "down_bias": ("ffn_down.bias", False),
}


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a path naming a `.gguf` file (existing or not)."""
    return str(path).lower().endswith(".gguf")


class GGUFFile:
    """A GGUF file opened with `gguf.GGUFReader`: metadata as Python values, tensors by name.

    Every read error of the format (a truncated or corrupt file) becomes a ValueError naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
            self.metadata = {name: _value(field) for name, field in self._reader.fields.items()}
            self.tensors = {t.name: t for t in self._reader.tensors}
            end = max((int(t.data_offset) + int(t.n_bytes) for t in self._reader.tensors), default=0)
        except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
            if "GGMLQuantizationType" in str(e):  # a type id newer than (or unknown to) the gguf package
                raise ValueError(f"GGUF file {self.path} has a tensor of unknown type ({e}); kvjax supports "
                                 f"{list(SUPPORTED_TENSOR_TYPES)}") from None
            raise ValueError(f"corrupt or truncated GGUF file {self.path}: {type(e).__name__}: {e}") from None
        if int(self.metadata.get("split.count", 1)) > 1:
            raise ValueError(f"GGUF file {self.path} is one of {self.metadata['split.count']} split files; "
                             "merge them first (llama.cpp's gguf-split --merge)")
        size = self.path.stat().st_size
        if end > size:
            raise ValueError(f"truncated GGUF file {self.path}: its tensors need {end} bytes, the file has {size}")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r} in {self.path}: kvjax supports "
                             f"{sorted(GGUF_ARCHITECTURES)}")
        return arch

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` dequantized to float32, in numpy (row-major, HF) order: `[out, in]` for weights."""
        if name not in self.tensors:
            raise KeyError(f"tensor {name!r} is missing from {self.path}")
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"tensor {name!r} in {self.path} has type {kind}, which kvjax cannot load; "
                             f"supported types: {list(SUPPORTED_TENSOR_TYPES)}")
        try:
            x = quants.dequantize(np.asarray(t.data), t.tensor_type)
        except Exception as e:
            raise ValueError(f"corrupt tensor {name!r} ({kind}) in {self.path}: {type(e).__name__}: {e}") from None
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        return np.asarray(x, np.float32).reshape(shape)


def _value(field: Any) -> Any:
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute` of Q/K rows (convert_hf_to_gguf.py, LlamaModel.permute).

    llama.cpp: `w.reshape(n_heads, 2, rows // n_heads // 2, ...).swapaxes(1, 2).reshape(w.shape)`,
    i.e. the half-split rotary pairs (j, j + D/2) of each head become adjacent rows (2j, 2j + 1).
    w: `[rows, ...]` with rows = n_heads * head_dim (a weight `[rows, in]` or a bias `[rows]`).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_dict(f: GGUFFile) -> dict[str, Any]:
    """The HF `config.json` equivalent of the file's metadata (fed to `ModelConfig.from_hf`)."""
    arch = f.architecture
    meta = f.metadata

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [f"{arch}.{k}" for k in required if get(k) is None]
    if missing:
        raise ValueError(f"GGUF file {f.path} lacks the metadata {missing}")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in meta else \
            int(f.tensors["token_embd.weight"].shape[1])
    hf: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF file {f.path}: unsupported rope scaling {scaling!r}; accepted values: "
                             "'none', 'linear' (and llama3 scaling stored as rope_freqs)")
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    if "rope_freqs.weight" in f.tensors:
        hf["rope_scaling"] = _llama3_scaling(f, hf)
    return hf


def _llama3_scaling(f: GGUFFile, hf: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1 RoPE scaling as per-frequency divisors (`rope_freqs`), not as metadata.

    The usual llama3 parameters (factor = the largest divisor, low 1, high 4, original context 8192)
    are accepted only if they reproduce those divisors.
    """
    divisors = f.tensor("rope_freqs.weight").reshape(-1)
    rope = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = ModelConfig.from_hf({**hf, "rope_scaling": None})
    scaled = ModelConfig.from_hf({**hf, "rope_scaling": rope})
    implied = inverse_frequencies(base) / inverse_frequencies(scaled)
    if implied.shape != divisors.shape or not np.allclose(implied, divisors, rtol=1e-4):
        raise ValueError(f"GGUF file {f.path}: its rope_freqs tensor is not llama3 RoPE scaling with "
                         f"factor {rope['factor']}, low 1, high 4, original context 8192; kvjax cannot load it")
    return rope


def load_gguf_params(f: GGUFFile, cfg: ModelConfig) -> dict[str, Any]:
    """Reads, dequantizes and stacks every tensor the config implies; host (NumPy) arrays in cfg.dtype."""
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(np.float32)
    shapes = param_shapes(cfg)
    permute = f.architecture == "llama"

    def read(name: str, shape: tuple[int, ...], transpose: bool, heads: int | None = None) -> np.ndarray:
        x = f.tensor(name)
        want = tuple(shape[::-1]) if transpose else tuple(shape)
        if x.shape != want:
            raise ValueError(f"tensor {name!r} in {f.path} has shape {x.shape}, but the metadata implies {want}")
        if heads is not None:
            x = unpermute_qk(x, heads)
        return (x.T if transpose else x).astype(dtype)

    params: dict[str, Any] = {
        "embed": read("token_embd.weight", shapes["embed"], False),
        "final_norm": read("output_norm.weight", shapes["final_norm"], False),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = read("output.weight", shapes["lm_head"], True)
    layers = {}
    for key, shape in shapes["layers"].items():
        suffix, transpose = _LAYER_TENSORS[key]
        heads = None
        if permute and key in ("q", "q_bias"):
            heads = cfg.num_heads
        elif permute and key in ("k", "k_bias"):
            heads = cfg.num_kv_heads
        stacked = np.empty(shape, dtype)
        for i in range(cfg.num_layers):
            stacked[i] = read(f"blk.{i}.{suffix}", shape[1:], transpose, heads)
        layers[key] = stacked
    params["layers"] = layers
    return params


def load_gguf(path: str | os.PathLike, dtype: str | None = None, tokenizer: bool = True
              ) -> tuple[ModelConfig, dict[str, Any], Any]:
    """(config, host params, tokenizer or None) from a GGUF file; dtype defaults to "float32"."""
    f = GGUFFile(path)
    hf = config_dict(f)
    # the weights need the layout implied by the metadata; biases are only read when present
    cfg = ModelConfig.from_hf(hf, dtype or "float32")
    if cfg.family == "llama" and "blk.0.attn_q.bias" in f.tensors:
        cfg = ModelConfig.from_hf({**hf, "attention_bias": True}, dtype or "float32")
    params = load_gguf_params(f, cfg)
    tok = build_tokenizer(f.metadata, name=str(f.path)) if tokenizer else None
    return cfg, params, tok
