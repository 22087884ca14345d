"""Tiny random Hugging Face models of every supported family, saved to a temp folder (test helper)."""

import pathlib

import torch
import transformers

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)

FAMILIES = {
    # Llama 2: multi-head attention, theta 1e4, untied
    "llama2": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    # Llama 3: GQA, theta 5e5
    "llama3": (transformers.LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0)),
    # Llama 3.1 / 3.2: llama3 RoPE scaling (small original context so the scaling matters), tied (as 3.2-1B)
    "llama3.1": (transformers.LlamaConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
    "mistral": (transformers.MistralConfig, dict(num_attention_heads=8, num_key_value_heads=4, sliding_window=None)),
    # Qwen2 / 2.5: q/k/v bias, tied
    "qwen2": (transformers.Qwen2Config, dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen3: q/k RMSNorm, head_dim != hidden / heads
    "qwen3": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             tie_word_embeddings=False)),
}
# Gemma 2 / Gemma 3 text, kept apart from FAMILIES (their caches carry rolling buffers: see tests/models/test_gemma.py).
# Window 8 so that short prompts already roll it; small soft-caps and a query_pre_attn_scalar != head_dim so
# that each Gemma feature changes the logits.
GEMMA_COMMON = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24)
GEMMA_FAMILIES = {
    # alternating sliding / full layers (HF's default pattern), attention and final soft-caps
    "gemma2": (transformers.Gemma2Config, dict(num_hidden_layers=4, attn_logit_softcapping=3.0,
                                               final_logit_softcapping=2.0)),
    # q/k norm, local RoPE base for sliding layers, linear-scaled global RoPE, an irregular layer pattern
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=5, rope_theta=1000.0, rope_local_base_freq=100.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
}
MODEL_CLASSES = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
    transformers.Gemma2Config: transformers.Gemma2ForCausalLM,
    transformers.Gemma3TextConfig: transformers.Gemma3ForCausalLM,
}


def build_hf(family: str, folder: pathlib.Path, seed: int = 0, **overrides):
    """A random HF model of `family` (weights perturbed so biases and norms are not trivial), saved to folder."""
    if family in GEMMA_FAMILIES:
        cfg_cls, extra = GEMMA_FAMILIES[family]
        extra = {**GEMMA_COMMON, **extra}
    else:
        cfg_cls, extra = FAMILIES[family]
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = MODEL_CLASSES[cfg_cls](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


