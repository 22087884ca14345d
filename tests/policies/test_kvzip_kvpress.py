"""`kvzip_kvpress` builds its reconstruction as kvpress 0.5.5's KVzipPress on chat-templated prompts.

The reference below is written from kvpress/presses/kvzip_press.py (0.5.5), not from kvjax's pass: the
chat template's prefix / suffix found from a dummy turn (`__call__`), the context after the prefix cut
into chunks and each repeat pass built with its instruction, the previous chunk's last 8 tokens and the
suffix (`_chunk_fn`, `prepare`), the subsampled softmax over sinks + chunk + the pass's keys maxed over
the group and the queries (`_compute_cross_attention`, `score_kvzip`), computed from transformers'
model in float64, then `compress_post`'s global pruning. The model is a tiny random Llama with the
vocabulary of SmolLM2-135M-Instruct, whose real tokenizer and chat template (from the GGUF fixture)
render the prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib

import numpy as np
import pytest
import torch
from tiny_models import build_hf

import kvjax
from kvjax.engine.inputs import chat_template_parts, prompt_format
from kvjax.policies import KVzip, get

FIXTURE = (pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "smollm2-135m-instruct"
           / "SmolLM2-135M-Instruct.Q4_1.gguf")
CONTEXTS = [
    "The harbour town kept its lighthouse lit through the winter. Fishermen counted the boats each evening, "
    "and the keeper wrote every name in a blue ledger that nobody else was allowed to read.",
    "Maria planted tomatoes, basil and three rows of beans. In August the beans climbed the fence.",
]
RATIO = 0.5
CHUNK = 16  # several chunks per prompt, the last one shorter
SHARPEN = 6.0  # q and k projections scaled: attention logits x 36


@functools.cache
def smollm2_tokenizer():
    if not FIXTURE.exists():
        msg = f"the SmolLM2 GGUF fixture is absent ({FIXTURE.resolve()})"
        if os.environ.get("CI"):
            pytest.fail(msg + ": CI must have it")
        pytest.skip(msg)
    from kvjax.models.gguf import GGUFFile
    from kvjax.models.gguf_tokenizer import build_tokenizer

    return build_tokenizer(GGUFFile(FIXTURE).metadata, name=str(FIXTURE))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(kvjax Model with the SmolLM2 tokenizer, the transformers model of the same weights)."""
    tok = smollm2_tokenizer()
    folder = tmp_path_factory.mktemp("kvzip_smollm2_vocab")
    hf = build_hf("llama3", folder, seed=3, vocab_size=len(tok))
    with torch.no_grad():  # sharper attention than the random init's near-uniform one
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    hf.save_pretrained(folder)
    model = dataclasses.replace(kvjax.load_model(folder), tokenizer=tok)
    return model, hf


def kvpress_prefix_suffix(tokenizer) -> tuple[int, list[int]]:
    """kvpress 0.5.5 `KVzipPress.__call__`: prefix_length and _suffix_ids from the chat template."""
    dummy_context = "dummy context"
    separator = "\n" + "#" * len(dummy_context)
    temp_context = tokenizer.apply_chat_template([{"role": "user", "content": dummy_context + separator}],
                                                 add_generation_prompt=True, tokenize=False, enable_thinking=False)
    context, suffix_text = temp_context.split(separator)
    prefix_text = context.split(dummy_context)[0]
    return (len(tokenizer.encode(prefix_text, add_special_tokens=False)),
            tokenizer.encode(suffix_text, add_special_tokens=False))


def kvpress_pairs(tokenizer, context_ids: list[int], prefix_length: int, suffix_ids: list[int], chunk_size: int,
                  prev_postfix_size: int = 8) -> list[tuple[list[int], list[int]]]:
    """kvpress 0.5.5 `_chunk_fn` + `prepare`: (chunk ids, repeat-pass ids) per chunk of the context."""
    ctx_ids = context_ids[prefix_length:]
    chunks = [ctx_ids[s:s + chunk_size] for s in range(0, len(ctx_ids), chunk_size)] if len(ctx_ids) > chunk_size \
        else [ctx_ids]
    pairs = []
    for i, a_ids in enumerate(chunks):
        if i == 0:
            q_ids = tokenizer.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
        else:
            q_ids = tokenizer.encode("\n\nRepeat the part of the previous context exactly, starting with",
                                     add_special_tokens=False)
            q_ids = q_ids + chunks[i - 1][-prev_postfix_size:]
        pairs.append((a_ids, q_ids + suffix_ids + a_ids))
    return pairs


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def kvpress_scores(hf, context_ids: list[int], pairs, prefix_length: int, n_sink: int = 4) -> np.ndarray:
    """kvpress 0.5.5 `score_kvzip` per pass (float64): score_val [L, Hkv, len(context_ids)]. One causal
    forward of context + pass gives the pass's hidden states and the cache (= prefill, then the pass
    against it)."""
    cfg = hf.config
    Hq, Hkv, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    D = cfg.hidden_size // Hq
    G, T = Hq // Hkv, len(context_ids)
    score = np.zeros((L, Hkv, T))
    start_idx = prefix_length
    for a_ids, repeat_ids in pairs:
        end_idx = start_idx + len(a_ids)
        q_len = len(repeat_ids)
        seen = {}
        hooks = [layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, l=l: seen.__setitem__(l, (kw["hidden_states"], kw["position_embeddings"])),
            with_kwargs=True) for l, layer in enumerate(hf.model.layers)]
        with torch.no_grad():
            res = hf(torch.tensor([context_ids + repeat_ids]), use_cache=True)
        for h in hooks:
            h.remove()
        for l, layer in enumerate(hf.model.layers):
            hs, (cos, sin) = seen[l]
            with torch.no_grad():
                q = layer.self_attn.q_proj(hs).view(1, -1, Hq, D).transpose(1, 2)
                q = (q * cos[:, None] + _rotate_half(q) * sin[:, None])[0, :, T:].double().numpy()  # [Hq,q_len,D]
            pkv = res.past_key_values
            keys = (pkv.layers[l].keys if hasattr(pkv, "layers") else pkv[l][0])[0].double().numpy()
            sink = min(n_sink, start_idx)
            cols = list(range(sink)) + list(range(start_idx, end_idx)) + list(range(T, T + q_len))
            for h in range(Hq):
                w = q[h] @ keys[h // G, cols].T / math.sqrt(D)
                w[:, -q_len:] = np.where(np.tril(np.ones((q_len, q_len), bool)), w[:, -q_len:], -np.inf)
                p = np.exp(w - w.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                best = p[:, sink:sink + len(a_ids)].max(0)
                score[l, h // G, start_idx:end_idx] = np.maximum(score[l, h // G, start_idx:end_idx], best)
        start_idx = end_idx
    return score


def kvpress_kept(score: np.ndarray, ratio: float, n_sink: int = 4) -> tuple[np.ndarray, float]:
    """kvpress 0.5.5 `compress_post` (layerwise=False): sinks get max + 1, the int(numel * r) lowest
    scores over all layers and heads are pruned. Returns kept [L, Hkv, T] and the score gap at the
    boundary (how far the kept set is from a float tie)."""
    s = score.copy()
    s[..., :n_sink] = s.max() + 1.0
    flat = s.reshape(-1)
    order = np.argsort(flat, kind="stable")
    n_pruned = int(flat.size * ratio)
    kept = np.ones(flat.size, bool)
    kept[order[:n_pruned]] = False
    gap = flat[order[n_pruned]] - flat[order[n_pruned - 1]]
    return kept.reshape(s.shape), float(gap)


def engine_kept(model, prompts, policy, lengths, **kw) -> list[np.ndarray]:
    """Per row b, kept [L, Hkv, lengths[b]] from `kvjax.engine.compress`."""
    cache = kvjax.engine.compress(model, prompts, policy=policy, compression_ratio=RATIO, **kw)
    valid, pos = np.asarray(cache.valid), np.asarray(cache.pos)
    rows = []
    for b, T in enumerate(lengths):
        kept = np.zeros((valid.shape[0], valid.shape[2], T), bool)
        for l in range(valid.shape[0]):
            for h in range(valid.shape[2]):
                kept[l, h, pos[l, b, h][valid[l, b, h]]] = True
        rows.append(kept)
    return rows


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_template_parts_are_kvpress_s(models):
    model, _ = models
    tok = model.tokenizer
    prefix, suffix = chat_template_parts(tok)
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_start|>user\n")
    assert suffix == "<|im_end|>\n<|im_start|>assistant\n"
    prefix_length, suffix_ids = kvpress_prefix_suffix(tok)
    fmt = prompt_format(model, [chat_ids(tok, CONTEXTS[0]), tok(CONTEXTS[0])["input_ids"]])
    assert len(fmt.prefix_ids) == prefix_length and list(fmt.suffix_ids) == suffix_ids
    assert fmt.templated == (True, False)
    fmt = dataclasses.replace(fmt, templated=(True, True))
    bound = get("kvzip_kvpress").for_prompts(fmt)
    assert bound.prefix == prefix_length == 24 and list(bound.suffix_ids) == suffix_ids
    assert list(bound.first_ids) == tok.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
    assert get("kvzip").for_prompts(fmt) == get("kvzip")  # the paper preset keeps its fixed passes


def test_kept_sets_equal_kvpress_construction(models):
    """Two chat-templated prompts of different lengths in one padded batch: each row's kept set is
    exactly kvpress's (reference margins checked, so that exact equality means something); the fixed
    construction (no prefix, no instruction) keeps a different set, so the comparison can fail."""
    model, hf = models
    tok = model.tokenizer
    policy = get("kvzip_kvpress", chunk_size=CHUNK)
    rows = [chat_ids(tok, text) for text in CONTEXTS]
    lengths = [len(r) for r in rows]
    assert lengths[0] != lengths[1]
    got = engine_kept(model, CONTEXTS, policy, lengths, chat_template=True)
    fixed = engine_kept(model, CONTEXTS, dataclasses.replace(policy, repeat="fixed"), lengths, chat_template=True)
    prefix_length, suffix_ids = kvpress_prefix_suffix(tok)
    for b, ids in enumerate(rows):
        pairs = kvpress_pairs(tok, ids, prefix_length, suffix_ids, CHUNK)
        assert len(pairs) >= 2 and len(pairs[-1][0]) < CHUNK  # several chunks, a ragged last one
        want, gap = kvpress_kept(kvpress_scores(hf, ids, pairs, prefix_length), RATIO)
        assert gap > 1e-6, f"row {b}: the reference's boundary is a near-tie ({gap})"
        assert got[b].shape == want.shape
        assert (got[b] == want).all(), f"row {b}: {int((got[b] != want).sum())} entries differ from kvpress's"
        assert (fixed[b] != want).any()
        assert not got[b][:, :, 4:prefix_length].any()  # the prefix past the sinks is never scored: pruned first


def test_raw_prompts_fall_back_and_mixed_batches_are_refused(models):
    """Raw prompts (no chat template applied) run the fixed passes, as before; a batch mixing raw and
    chat-templated prompts is refused with the rows named."""
    model, _ = models
    tok = model.tokenizer
    policy = get("kvzip_kvpress", chunk_size=CHUNK)
    lengths = [len(tok(text)["input_ids"]) for text in CONTEXTS]
    raw = engine_kept(model, CONTEXTS, policy, lengths)
    fixed = engine_kept(model, CONTEXTS, dataclasses.replace(policy, repeat="fixed"), lengths)
    for a, b in zip(raw, fixed):
        assert (a == b).all()
    templated = chat_ids(tok, CONTEXTS[0])
    with pytest.raises(ValueError, match=r"rows \[1\] do not start with the template's prefix"):
        kvjax.engine.compress(model, [templated, tok(CONTEXTS[1])["input_ids"]], policy=policy,
                              compression_ratio=RATIO)
    out = kvjax.engine.generate_settings(model, [templated, tok(CONTEXTS[1])["input_ids"]],
                                         [("kvzip_kvpress", RATIO), ("kvzip", RATIO)], max_new_tokens=1,
                                         on_error="return")
    assert isinstance(out[0], ValueError) and "kvzip_kvpress" in str(out[0])
    assert not isinstance(out[1], ValueError)
    with pytest.raises(ValueError, match="repeat"):
        KVzip(repeat="kvzip")


def test_template_parts_without_a_usable_template():
    """No tokenizer, no template, a template that refuses a lone user turn or rewrites its content: the
    engine knows no prompt format (KVzip then runs its fixed passes); a plain one is cut around the content."""

    class Template:
        chat_template = "a template"

        def __init__(self, render):
            self.render = render

        def apply_chat_template(self, messages, **kw):
            return self.render(messages[0]["content"])

    def refuse(content):
        raise RuntimeError("this template needs a system turn")

    class NoTemplate:
        chat_template = None

    assert chat_template_parts(None) is None and chat_template_parts(NoTemplate()) is None
    assert chat_template_parts(Template(refuse)) is None
    assert chat_template_parts(Template(lambda c: "<u>" + c.upper() + "</u>")) is None
    assert chat_template_parts(Template(lambda c: "<s><u>" + c + "</u><a>")) == ("<s><u>", "</u><a>")
