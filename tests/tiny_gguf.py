"""Tiny GGUF files written with `gguf.GGUFWriter` from tiny random HF models (test helper).

The HF tensors are converted as llama.cpp's convert_hf_to_gguf.py does: renamed, Q/K rows of the
`llama` architecture permuted, 2-D weights optionally quantized, norms and biases kept in F32. A tiny
byte-level BPE vocabulary (trained here with `tokenizers`) with ChatML control tokens and a chat
template goes into the metadata.
"""

import json
import math
import pathlib

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tiny_models import COMMON, FAMILIES, MODEL_CLASSES

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["The capital of France is Paris. The quick brown fox jumps over the lazy dog 12345 times.",
          "What is the magic number? It's 7 or 42, they'll say; we've seen   spaces\n\nand new lines.",
          "Once upon a time there was a little girl who liked to play in the park with her friends."] * 20
TEXTS = ["The capital of France is Paris.", "It's 2048 or 12345, isn't it?  Two  spaces\nnew line",
         "<|im_start|>user\nhello<|im_end|>", "unseen wörds ünïcode ✓"]


def tiny_vocab(vocab_size: int = 320) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges "a b") of a byte-level BPE trained on CORPUS; specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, merges


def tiny_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a tiny SentencePiece-style vocabulary (byte fallback, "▁" spaces)."""
    pieces = ["▁"] + sorted({c for text in CORPUS for c in text if not c.isspace()})
    words = sorted({"▁" + w for text in CORPUS for w in text.split()})[:40]
    pairs = sorted({w[:2] for w in words if len(w) > 2})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces + pairs + words
    tokens = list(dict.fromkeys(tokens))
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    return tokens, scores, types


def llama3_rope_factors(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs` divisors for llama3 RoPE scaling (convert_hf_to_gguf.py, LlamaModel)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_NAMES[module]}.{kind}"


def write_gguf(family: str, folder: pathlib.Path, *, qtype: T = T.F32, arch: str | None = None,
               add_bos: bool = True, pre: str | None = None, seed: int = 0, name: str = "model.gguf",
               overrides: dict | None = None, qtypes: dict | None = None, spm: bool = False) -> tuple[pathlib.Path, torch.nn.Module]:
    """Writes a tiny GGUF of `family` (tiny_models.FAMILIES) into folder; returns (path, the HF model).

    qtype: the type of 2-D weights (norms and biases stay F32); qtypes: per-GGUF-name overrides, given
    as a type or a function `(float32 array) -> (bytes array, type)` for types gguf cannot quantize.
    arch: the GGUF architecture written (default: the family's).
    spm: a SentencePiece vocabulary (tokenizer.ggml.model "llama") instead of byte-level BPE.
    """
    if spm:
        tokens, scores, types = tiny_spm_vocab()
    else:
        tokens, merges = tiny_vocab()
        types = [3 if t in SPECIALS else 1 for t in tokens]
    cfg_cls, extra = FAMILIES[family]
    cfg = cfg_cls(**{**COMMON, **extra, "vocab_size": len(tokens), "bos_token_id": 1, "eos_token_id": 2,
                     **(overrides or {})})
    torch.manual_seed(seed)
    model = MODEL_CLASSES[cfg_cls](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    arch = arch or {"llama2": "llama", "llama3": "llama", "llama3.1": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[family]
    path = folder / name
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_token_list(tokens)
    w.add_token_types(types)
    if spm:
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or ("qwen2" if arch.startswith("qwen") else "llama-bpe"))
        w.add_token_merges(merges)
        w.add_pad_token_id(0)
        w.add_chat_template(CHATML)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    tied = cfg.tie_word_embeddings
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        x = t.float().numpy().copy()
        name_ = gguf_name(hf_name)
        if arch == "llama" and ".attn_q." in name_:
            x = _permute(x, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name_:
            x = _permute(x, cfg.num_key_value_heads)
        kind = (qtypes or {}).get(name_, qtype if x.ndim == 2 else T.F32)
        if callable(kind):
            data, kind = kind(x)
        elif kind == T.F32:
            data = x
        elif kind == T.F16:
            data = x.astype(np.float16)
        else:
            data = quants.quantize(x, kind)
        w.add_tensor(name_, data, raw_dtype=kind if kind not in (T.F32, T.F16) else None)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(float(rope["rope_theta"]), head_dim, rope))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model
