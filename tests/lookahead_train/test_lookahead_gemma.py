"""LookaheadKV training on models with sliding-window layers (tiny random Gemma 2 and Gemma 3): the
whole pipeline (targets, a few train steps on one fixed batch, export) runs, the loss is finite and
falls, the adapter moves, and the saved adapter loads and drives the `lookahead_kv` policy in
`kvjax.generate`. Targets and observations cover the global layers only: [num_global_layers, ...]."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import GEMMA_FAMILIES, build_hf

import kvjax
import kvjax.lookahead as lk
from kvjax.training import read_log
from train_lookahead.config import RunConfig
from train_lookahead.pipeline import run
from train_lookahead.targets import TargetRecords

BATCH, PROMPT, RESPONSE, STEPS = 4, 24, 6, 6
LA = {"n_tokens": 4, "rank": 2, "alpha": 4.0}


@pytest.fixture(scope="module")
def gemma_folders(tmp_path_factory):
    """family -> folder of a tiny random HF model (window 8: the 14-24-token prompts roll it)."""
    out = {}
    for family in GEMMA_FAMILIES:
        out[family] = tmp_path_factory.mktemp(family)
        build_hf(family, out[family])
    return out


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [[1] + rng.randint(3, vocab, n - 1).tolist() for n in (PROMPT, 19, 14, PROMPT)]


def test_the_tiny_gemmas_have_sliding_window_layers(gemma_folders):
    for folder in gemma_folders.values():
        cfg = kvjax.load_model(folder, tokenizer=False).config
        assert cfg.local_layer_ids and 0 < cfg.num_global_layers < cfg.num_layers


@pytest.mark.parametrize("family, mode", [("gemma2", "stored"), ("gemma3", "on_the_fly")])
def test_lookahead_trains_on_gemma_and_its_adapter_runs_in_generate(gemma_folders, tmp_path, family, mode):
    folder = gemma_folders[family]
    model = kvjax.load_model(folder)
    cfg = model.config
    rows = prompts(cfg.vocab_size)
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"tokens": r}) + "\n" for r in rows))
    conf = RunConfig.from_dict({
        "model": {"path": str(folder)}, "lookahead": LA,
        "data": {"max_prompt_tokens": PROMPT, "sources": [{"kind": "jsonl", "path": str(source)}]},
        "targets": {"max_response_tokens": RESPONSE, "batch_size": BATCH, "mode": mode},
        # as many records as the batch: every step trains on the same 4 prompts
        "train": {"steps": STEPS, "batch_size": BATCH, "checkpoint_every": 3, "log_every": 1},
        "optim": {"learning_rate": 3e-2, "warmup_fraction": 0.0}, "mesh": {"data": 1, "model": 1}})
    export = run(conf, tmp_path / "work", progress=False)

    records = TargetRecords(tmp_path / "work" / "targets")
    assert len(records) == BATCH
    if mode == "stored":  # s_GT of the global layers only, for each query head and prompt token
        assert records[0]["target"].shape == (cfg.num_global_layers, cfg.num_heads, len(rows[0]))

    log = read_log(tmp_path / "work")
    losses = [r["loss"] for r in log]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert np.all(np.isfinite(losses)) and losses[0] > 0
    assert losses[-1] < 0.9 * losses[0], losses  # the same batch every step: the KL must fall

    adapter = lk.load(export, model=model)
    start = lk.init_adapter(model, adapter.config, jax.random.PRNGKey(conf.train.seed))
    assert np.abs(np.asarray(adapter.params["embeddings"]) - np.asarray(start.params["embeddings"])).max() > 1e-3
    assert max(float(np.abs(np.asarray(f["b"])).max()) for f in adapter.params["lora"].values()) > 0  # B starts at 0

    policy = kvjax.policies.LookaheadKV(adapter=adapter)
    out = kvjax.generate(model, rows, policy=policy, compression_ratio=0.5, max_new_tokens=4, stop_tokens=[])
    assert out.tokens.shape == (len(rows), 4)
    # the policy compressed each row's cache to about half of its prompt
    assert np.all(out.budget_reached) and np.all(out.kept < 0.6 * np.array([len(r) for r in rows]))


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_response_attention_covers_the_global_layers(gemma_folders, family):
    """s_GT against the frozen prompt cache (global layers plus rolling buffers): [num_global_layers, B,
    Hq, T], each row a distribution over its prompt slots; s̃ has the same shape."""
    model = kvjax.load_model(gemma_folders[family], tokenizer=False)
    cfg = model.config
    rows = prompts(cfg.vocab_size, seed=1)
    tokens = np.zeros((len(rows), PROMPT), np.int32)
    positions = np.full((len(rows), PROMPT), -1, np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)], positions[b, : len(r)] = r, np.arange(len(r))
    lengths = (positions >= 0).sum(-1)
    cache = lk.prompt_cache(model.params, cfg, tokens, positions)
    assert cache.k.shape[0] == cfg.num_global_layers and cache.local is not None
    response = np.random.RandomState(2).randint(3, cfg.vocab_size, (len(rows), RESPONSE)).astype(np.int32)
    response_positions = (lengths[:, None] + np.arange(RESPONSE)).astype(np.int32)
    target = np.asarray(lk.response_attention(model.params, cfg, cache, response, response_positions))
    assert target.shape == (cfg.num_global_layers, len(rows), cfg.num_heads, PROMPT)
    # the response also attends to itself: what it gives the prompt is positive and at most 1 per query head
    assert np.all(target >= 0) and np.all(target.sum(-1) > 0.05) and np.all(target.sum(-1) <= 1 + 1e-5)
    assert np.all(target[..., PROMPT - 1][:, lengths < PROMPT] == 0)  # padding slots get nothing
    adapter = lk.init_adapter(model, lk.LookaheadConfig(**LA), jax.random.PRNGKey(0))
    predicted = lk.predicted_attention(model.params, cfg, adapter.params, adapter.config, cache,
                                       jnp.asarray(lengths, jnp.int32))
    assert predicted.shape == target.shape
