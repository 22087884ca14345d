"""Logits and greedy generation against Hugging Face transformers (PyTorch, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
from kvjax.models import extend
from kvjax.models.local import init_cache

from tiny_models import FAMILIES, build_hf

RNG = np.random.RandomState(0)
# one compile per shape (prefill, decode step) instead of one per call
_extend = jax.jit(extend, static_argnames=("cfg", "fresh"))


def _ours_prefill_then_decode(model, prompts, continuation):
    """Batched right-padded prefill, then token-by-token decode of `continuation` [B, n]."""
    cfg = model.config
    B, T = len(prompts), max(map(len, prompts))
    n = continuation.shape[1]
    tokens = np.zeros((B, T), np.int32)
    positions = np.full((B, T), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = np.arange(len(p))
    cache = init_cache(cfg, B, T + n)
    logits, cache, _ = _extend(model.params, cfg, cache, jnp.asarray(tokens), jnp.asarray(positions), fresh=True)
    steps = []
    lengths = np.array([len(p) for p in prompts])
    for i in range(n):
        step_logits, cache, _ = _extend(model.params, cfg, cache, jnp.asarray(continuation[:, i : i + 1]),
                                       jnp.asarray(lengths[:, None] + i), fresh=False)
        steps.append(np.asarray(step_logits[:, 0]))
    return np.asarray(logits), np.stack(steps, 1)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def _check_family(hf, folder, dtype="float32", rtol=1e-4):
    model = kvjax.load_model(folder, dtype=dtype)
    vocab = model.config.vocab_size
    prompts = [RNG.randint(3, vocab, n).tolist() for n in (9, 23, 16)]
    continuation = RNG.randint(3, vocab, (3, 5)).astype(np.int32)
    prefill, decode = _ours_prefill_then_decode(model, prompts, continuation)
    for b, p in enumerate(prompts):
        ref = _hf_logits(hf, p + continuation[b].tolist())
        scale = np.abs(ref).max()
        np.testing.assert_array_less(np.abs(prefill[b, : len(p)] - ref[: len(p)]).max(), rtol * scale)
        # decode step i consumes continuation[i] at position len(p)+i: compare with HF's logits there
        np.testing.assert_array_less(np.abs(decode[b] - ref[len(p):]).max(), rtol * scale)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(hf_models, family):
    hf, folder = hf_models[family]
    _check_family(hf, folder)


@pytest.mark.parametrize("family", ["llama3.1", "qwen3"])
def test_bfloat16_logits_close_to_float32_reference(hf_models, family):
    hf, folder = hf_models[family]
    model = kvjax.load_model(folder, dtype="bfloat16")
    assert model.params["layers"]["q"].dtype == jnp.bfloat16
    _check_family(hf, folder, dtype="bfloat16", rtol=5e-2)


def test_fixture_logits_match_transformers(stories_path):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    _check_family(hf, stories_path)


def _hf_greedy_batch(hf, prompts, n, pad_id=0):
    """transformers' greedy generate on a left-padded batch (how HF batches prompts)."""
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad_id)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=pad_id)
    return out[:, T:].numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(hf_models, family):
    hf, folder = hf_models[family]
    model = kvjax.load_model(folder)
    prompts = [RNG.randint(3, model.config.vocab_size, n).tolist() for n in (4, 19, 11, 30)]
    out = kvjax.generate(model, prompts, max_new_tokens=10, stop_tokens=[])
    np.testing.assert_array_equal(out.tokens, _hf_greedy_batch(hf, prompts, 10))


def test_fixture_greedy_generation_matches_transformers(stories_path):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    model = kvjax.load_model(stories_path)
    prompts = [[1] + RNG.randint(3, 512, n).tolist() for n in (6, 40, 25)]
    out = kvjax.generate(model, prompts, max_new_tokens=20, stop_tokens=[])
    np.testing.assert_array_equal(out.tokens, _hf_greedy_batch(hf, prompts, 20))


@pytest.mark.parametrize("family, left", [("llama3", False), ("qwen2", True)])
def test_long_padded_prefill_matches_transformers(tmp_path, family, left):
    """A batch of prompts longer than QUERY_BLOCK (so the flash prefill runs several query and key
    blocks), right- or left-padded: every real token's logits and the cached keys and values equal
    transformers' for each prompt alone."""
    hf = build_hf(family, tmp_path, max_position_embeddings=2048)
    model = kvjax.load_model(tmp_path)
    cfg = model.config
    lengths, T = (1500, 1100), 1500
    prompts = [RNG.randint(3, cfg.vocab_size, n).tolist() for n in lengths]
    tokens = np.zeros((2, T), np.int32)
    positions = np.full((2, T), -1, np.int32)
    for b, p in enumerate(prompts):
        cols = slice(T - len(p), T) if left else slice(0, len(p))
        tokens[b, cols], positions[b, cols] = p, np.arange(len(p))
    logits, cache, _ = _extend(model.params, cfg, init_cache(cfg, 2, T), jnp.asarray(tokens), jnp.asarray(positions),
                               fresh=True)
    for b, p in enumerate(prompts):
        cols = slice(T - len(p), T) if left else slice(0, len(p))
        with torch.no_grad():
            out = hf(torch.tensor([p]), use_cache=True)
        ref = out.logits[0].numpy()
        np.testing.assert_array_less(np.abs(np.asarray(logits[b, cols]) - ref).max(), 1e-4 * np.abs(ref).max())
        for layer in range(cfg.num_layers):
            kv = out.past_key_values.layers[layer]
            np.testing.assert_allclose(np.asarray(cache.k[layer, b, :, cols]), kv.keys[0].numpy(), atol=1e-4)
            np.testing.assert_allclose(np.asarray(cache.v[layer, b, :, cols]), kv.values[0].numpy(), atol=1e-4)
