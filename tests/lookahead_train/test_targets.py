"""Target generation: the frozen model's greedy response and its mean response->prompt attention
(policies.md §11.1) equal Hugging Face transformers' full-sequence attentions; the stage resumes; a stored
prompt cache is the prefill it replaces."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from kvzip_reference import hf_kvzip_scores

import kvjax
from kvjax.lookahead import LookaheadConfig, init_adapter, join_prompt_cache, prompt_cache
from train_lookahead.config import DataSection, SourceSection, TargetsSection
from train_lookahead.data import _layers_first, to_example
from train_lookahead.loss import lookahead_loss
from train_lookahead.targets import KVZIP_PASS, TargetRecords, chunk_targets, generate_targets

PROMPTS = [[1, 45, 300, 17, 88, 402, 9, 77, 150, 33, 61, 12], [1, 200, 5, 99, 321, 44, 7],
           [1, 10, 20, 30, 40, 50, 60, 70, 80]]


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


@pytest.fixture(scope="module")
def hf(stories_path):
    return transformers.LlamaForCausalLM.from_pretrained(stories_path, attn_implementation="eager").eval()


def test_targets_equal_transformers_attention(stories, hf):
    out = chunk_targets(stories, PROMPTS, max_prompt_tokens=16, max_response_tokens=10, batch_size=4)
    L, Hq = stories.config.num_layers, stories.config.num_heads
    assert out["target"].shape == (3, L, Hq, 12)
    for b, prompt in enumerate(PROMPTS):
        T, m = len(prompt), int(out["response_lengths"][b])
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=2,
                              pad_token_id=0)[0, T:].tolist()
        response = out["response"][b, :m].tolist()
        assert response == gen[:m] and (m == 10 or response[-1] == 2)  # greedy, up to and with the stop token
        with torch.no_grad():
            att = hf(torch.tensor([prompt + response]), output_attentions=True).attentions
        expected = np.stack([a[0, :, T:T + m, :T].mean(1).numpy() for a in att])  # [L, Hq, T]
        np.testing.assert_allclose(out["target"][b, :, :, :T], expected, atol=2e-5)
        assert (out["target"][b, :, :, T:] == 0).all()
    assert out["lengths"].tolist() == [len(p) for p in PROMPTS]


def test_target_stage_resumes_chunk_by_chunk(stories, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS + [[1] * 40]))
    data = DataSection(sources=(SourceSection(kind="jsonl", path=str(path)),), max_prompt_tokens=16)
    targets = TargetsSection(max_response_tokens=6, batch_size=2)
    folder = generate_targets(stories, data, targets, tmp_path, progress=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["chunks"] == [2, 1] and manifest["skipped_long"] == 1  # the 40-token prompt is skipped, counted
    first = np.load(folder / "chunk_00000" / "target.npy")
    stamp = os.stat(folder / "chunk_00000" / "target.npy").st_mtime_ns
    second = np.load(folder / "chunk_00001" / "target.npy")
    # as if killed while writing chunk 1: only chunk 1 is redone, to the same result
    (folder / "manifest.json").unlink()
    for f in (folder / "chunk_00001").iterdir():
        f.unlink()
    (folder / "chunk_00001").rmdir()
    generate_targets(stories, data, targets, tmp_path, progress=False)
    assert os.stat(folder / "chunk_00000" / "target.npy").st_mtime_ns == stamp
    np.testing.assert_array_equal(np.load(folder / "chunk_00001" / "target.npy"), second)
    records = TargetRecords(folder)
    assert len(records) == 3
    np.testing.assert_array_equal(records[1]["target"], first[1, ..., : len(PROMPTS[1])])
    assert records[2]["tokens"].tolist() == PROMPTS[2]
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        generate_targets(stories, DataSection(sources=data.sources, max_prompt_tokens=32), targets, tmp_path)
    with pytest.raises(ValueError, match="40 tokens"):
        generate_targets(stories, DataSection(sources=data.sources, max_prompt_tokens=16, long_prompts="error"),
                         targets, tmp_path / "other")


@pytest.mark.slow
def test_on_the_fly_loss_equals_the_loss_on_stored_targets(stories):
    """The one-prefill on-the-fly loss (response pass + lookahead rows on one cache) equals
    kvjax.lookahead.loss_fn on the stored targets of the same prompts, value and gradient."""
    la = LookaheadConfig(n_tokens=3, rank=2, alpha=4.0)
    out = chunk_targets(stories, PROMPTS, max_prompt_tokens=16, max_response_tokens=10, batch_size=3)
    stored, fly = [], []
    for b in range(3):
        n, m = int(out["lengths"][b]), int(out["response_lengths"][b])
        stored.append(to_example({"tokens": out["tokens"][b, :n], "target": out["target"][b, ..., :n]}, 16))
        fly.append(to_example({"tokens": out["tokens"][b, :n], "response": out["response"][b, :m]}, 16, 10))
    stack = lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    stored, fly = stack(stored), stack(fly)
    stored["target"] = stored["target"].transpose(1, 0, 2, 3)
    assert (fly["response_positions"][0, : out["response_lengths"][0]] == len(PROMPTS[0]) + np.arange(
        out["response_lengths"][0])).all()
    adapter = init_adapter(stories, la, jax.random.PRNGKey(1))
    params = jax.tree.map(lambda x: x + 0.05, adapter.params)  # B != 0: the LoRA matters
    loss = lookahead_loss(stories.config, la)
    grad = jax.jit(jax.value_and_grad(loss))
    a, ga = grad(params, stories.params, stored)
    b, gb = grad(params, stories.params, fly)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from tiny_models import build_hf  # a tiny random Gemma 2: sliding-window layers (window 8) beside global ones

    folder = tmp_path_factory.mktemp("gemma2")
    build_hf("gemma2", folder)
    return kvjax.load_model(folder, tokenizer=False)


@pytest.mark.parametrize("name", ["stories", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_a_stored_prompt_cache_is_the_prefill_and_gives_the_same_loss(request, tmp_path, name):
    """targets.prompt_cache: the cache a train batch rebuilds from the stored arrays equals the frozen
    prefill of the batch's prompts (global layers and, on Gemma 2, the rolling buffers of its
    sliding-window layers), and the loss and its gradient equal those of the step that prefills."""
    model = request.getfixturevalue(name)
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, min(cfg.vocab_size, 512), n - 1).tolist() for n in (16, 11, 7, 14)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in prompts))
    data = DataSection(sources=(SourceSection(kind="jsonl", path=str(path)),), max_prompt_tokens=16)
    folder = generate_targets(model, data, TargetsSection(max_response_tokens=5, batch_size=3, prompt_cache=True),
                              tmp_path, progress=False)
    records = TargetRecords(folder)
    rec = records[1]
    assert rec["prompt_k"].shape == (cfg.num_global_layers, cfg.num_kv_heads, len(prompts[1]), cfg.head_dim)
    assert rec["prompt_k"].dtype == cfg.jnp_dtype
    assert ("prompt_local_k" in rec) == bool(cfg.local_layer_ids)
    batch = _layers_first({k: np.stack([to_example(records[i], 16)[k] for i in range(4)])
                           for k in to_example(rec, 16)})
    rebuilt = join_prompt_cache(batch, batch["positions"])
    fresh = prompt_cache(model.params, cfg, batch["tokens"], batch["positions"])
    # the prefill also writes the padding tokens' keys and values into the (invalid) slots past a prompt
    empty = ~fresh.valid[..., None]
    fresh = fresh.replace(k=jnp.where(empty, 0, fresh.k), v=jnp.where(empty, 0, fresh.v))
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(fresh), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=5e-5)  # batched as 3 vs 4 rows
    la = LookaheadConfig(n_tokens=3, rank=2, alpha=4.0)
    params = jax.tree.map(lambda x: x + 0.05, init_adapter(model, la, jax.random.PRNGKey(1)).params)
    grad = jax.jit(jax.value_and_grad(lookahead_loss(cfg, la)))
    a, ga = grad(params, model.params, batch)
    b, gb = grad(params, model.params, {k: v for k, v in batch.items() if not k.startswith("prompt_")})
    assert np.isfinite(float(a))
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
    # and the step reads the stored keys rather than prefilling: other keys, another loss
    c, _ = grad(params, model.params, {**batch, "prompt_k": batch["prompt_k"][:, ::-1]})
    assert abs(float(c) - float(a)) > 1e-4


def test_prompt_cache_needs_stored_targets():
    with pytest.raises(ValueError, match="targets.prompt_cache.*mode: stored"):
        TargetsSection(mode="on_the_fly", prompt_cache=True)


def test_kvzip_teacher_targets_equal_transformers_reconstruction(stories, hf):
    """teacher "kvzip": each query head's target is its KV head's KVzip score (the `kvzip` preset's repeat
    pass, recomputed in PyTorch), zero past the prompt; no response is generated."""
    out = chunk_targets(stories, PROMPTS, max_prompt_tokens=16, max_response_tokens=10, batch_size=4,
                        teacher="kvzip", with_cache=True)
    cfg = stories.config
    G = cfg.num_heads // cfg.num_kv_heads
    assert "response" not in out and out["target"].shape == (3, cfg.num_layers, cfg.num_heads, 12)
    assert out["prompt_k"].shape[:4] == (3, cfg.num_layers, cfg.num_kv_heads, 12)
    for b, prompt in enumerate(PROMPTS):
        T = len(prompt)
        want = hf_kvzip_scores(hf, prompt, KVZIP_PASS)  # [L, Hkv, T]
        np.testing.assert_allclose(out["target"][b, :, :, :T], np.repeat(want, G, axis=1), rtol=2e-4, atol=1e-6)
        assert (out["target"][b, :, :, T:] == 0).all()


def test_kvzip_teacher_stage_trains_on_agnostic_contexts(stories, tmp_path):
    """The stage with teacher "kvzip" writes KVzip targets a train batch reads, records the teacher in its
    settings (a folder of response targets does not resume as one of KVzip's), and a `query_aware: false`
    source's prompts are the contexts alone."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    data = DataSection(sources=(SourceSection(kind="jsonl", path=str(path)),), max_prompt_tokens=16)
    folder = generate_targets(stories, data, TargetsSection(batch_size=2, teacher="kvzip", prompt_cache=True),
                              tmp_path, progress=False)
    assert json.loads((folder / "settings.json").read_text())["teacher"] == "kvzip"
    records = TargetRecords(folder)
    direct = chunk_targets(stories, PROMPTS[:2], max_prompt_tokens=16, max_response_tokens=1, batch_size=2,
                           teacher="kvzip")
    np.testing.assert_allclose(records[1]["target"], direct["target"][1, ..., :len(PROMPTS[1])], atol=1e-6)
    with pytest.raises(ValueError, match="teacher"):
        generate_targets(stories, data, TargetsSection(batch_size=2, prompt_cache=True), tmp_path, progress=False)


def test_kvzip_teacher_config_errors():
    with pytest.raises(ValueError, match="targets.teacher.*'response', 'kvzip'"):
        TargetsSection(teacher="snapkv")
    with pytest.raises(ValueError, match="targets.teacher: kvzip needs targets.mode: stored"):
        TargetsSection(mode="on_the_fly", teacher="kvzip")
    with pytest.raises(ValueError, match="query_aware: false applies to synthetic sources only"):
        SourceSection(kind="jsonl", path="x.jsonl", query_aware=False)


def test_query_agnostic_training_scores_the_context_alone(stories, tmp_path):
    """train.query_aware: false cuts each record to its context: the lookahead tokens follow the context and the
    loss covers its entries only, against the whole prompt's target there. With the stored cache it equals the
    loss of prefilling the context alone; it differs from the query-aware loss; records without a context fail."""
    cfg = stories.config
    out = chunk_targets(stories, PROMPTS, max_prompt_tokens=16, max_response_tokens=5, batch_size=3, with_cache=True)
    contexts = [7, 4, 6]
    recs = [{"tokens": out["tokens"][b, :len(p)], "target": out["target"][b, ..., :len(p)],
             "prompt_k": out["prompt_k"][b, :, :, :len(p)], "prompt_v": out["prompt_v"][b, :, :, :len(p)],
             "context_tokens": c} for b, (p, c) in enumerate(zip(PROMPTS, contexts))]

    def batch(examples):
        return _layers_first({k: np.stack([e[k] for e in examples]) for k in examples[0]})

    agnostic = batch([to_example(r, 16, query_aware=False) for r in recs])
    assert (agnostic["positions"] >= 0).sum(axis=1).tolist() == contexts
    prefill = batch([to_example({"tokens": r["tokens"][:c], "target": r["target"][..., :c]}, 16)
                     for r, c in zip(recs, contexts)])
    aware = batch([to_example(r, 16) for r in recs])
    la = LookaheadConfig(n_tokens=3, rank=2, alpha=4.0)
    params = jax.tree.map(lambda x: x + 0.05, init_adapter(stories, la, jax.random.PRNGKey(1)).params)
    loss = jax.jit(lookahead_loss(cfg, la))
    a, b, c = (float(loss(params, stories.params, x)) for x in (agnostic, prefill, aware))
    np.testing.assert_allclose(a, b, rtol=1e-5)
    assert abs(a - c) > 1e-3
    with pytest.raises(ValueError, match="query_aware: false needs stored targets whose records know their context"):
        to_example({k: v for k, v in recs[0].items() if k != "context_tokens"}, 16, query_aware=False)


ANSWERS = [[5, 6, 7, 8], [300, 2], [9] * 14]


def test_answer_teacher_targets_equal_transformers_attention_of_the_given_answer(stories, hf):
    """teacher "answer": no response is generated; the given reference answer (cut to max_response_tokens) is read
    as the continuation and the target is its mean attention to the prompt, as transformers computes it."""
    out = chunk_targets(stories, PROMPTS, max_prompt_tokens=16, max_response_tokens=10, batch_size=4,
                        teacher="answer", answers=ANSWERS)
    assert out["response_lengths"].tolist() == [4, 2, 10]
    for b, prompt in enumerate(PROMPTS):
        T, answer = len(prompt), ANSWERS[b][:10]
        assert out["response"][b, :len(answer)].tolist() == answer
        with torch.no_grad():
            att = hf(torch.tensor([prompt + answer]), output_attentions=True).attentions
        expected = np.stack([a[0, :, T:, :T].mean(1).numpy() for a in att])  # [L, Hq, T]
        np.testing.assert_allclose(out["target"][b, :, :, :T], expected, atol=2e-5)
    with pytest.raises(ValueError, match="teacher: answer needs a non-empty reference answer"):
        chunk_targets(stories, PROMPTS, max_prompt_tokens=16, max_response_tokens=10, batch_size=4,
                      teacher="answer", answers=[[5], [], [6]])


def test_answer_teacher_stage_reads_answers_from_rows_and_names_a_missing_one(stories, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"tokens": p, "answer_tokens": a}) + "\n" for p, a in zip(PROMPTS, ANSWERS)))
    data = DataSection(sources=(SourceSection(kind="jsonl", path=str(path)),), max_prompt_tokens=16)
    targets = TargetsSection(batch_size=2, max_response_tokens=10, teacher="answer", prompt_cache=True)
    folder = generate_targets(stories, data, targets, tmp_path / "a", progress=False)
    records = TargetRecords(folder)
    assert np.load(folder / "chunk_00001" / "response.npy")[0].tolist() == ANSWERS[2][:10]
    direct = chunk_targets(stories, PROMPTS[2:], max_prompt_tokens=16, max_response_tokens=10, batch_size=2,
                           teacher="answer", answers=ANSWERS[2:])
    np.testing.assert_allclose(records[2]["target"], direct["target"][0], atol=1e-6)
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    with pytest.raises(ValueError, match=r"p.jsonl|bare.jsonl/0: targets.teacher: answer needs .*'answer_tokens'"):
        generate_targets(stories, DataSection(sources=(SourceSection(kind="jsonl", path=str(bare)),),
                                              max_prompt_tokens=16), targets, tmp_path / "b", progress=False)
