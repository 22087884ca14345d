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
MODEL_CLASSES = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
}


def build_hf(family: str, folder: pathlib.Path, seed: int = 0, **overrides):
    """A random HF model of `family` (weights perturbed so biases and norms are not trivial), saved to folder."""
    cfg_cls, extra = FAMILIES[family]
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = MODEL_CLASSES[cfg_cls](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


