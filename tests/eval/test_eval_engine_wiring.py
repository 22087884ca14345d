"""The real engine behind `python -m kvjax.eval`: a tiny random Llama with the bundled tokenizer."""

import json
import shutil

import pytest

from kvjax.tokenizer import TOKENIZER_DIR


@pytest.mark.slow
def test_cli_runs_kvjax_generate_end_to_end(tmp_path):
    from tiny_models import build_hf

    from kvjax.eval.cli import main

    model_dir = tmp_path / "model"
    build_hf("llama3", model_dir, vocab_size=2560, max_position_embeddings=1024, pad_token_id=0)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, model_dir / f.name)
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--tasks", "passkey", "--num-samples", "3", "--batch-size", "2",
            "--context-length", "384", "--policies", "snapkv", "--compression-ratios", "0.5",
            "--max-new-tokens", "4", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    full = [r for r in rows if r["policy"] == "full"]
    snap = [r for r in rows if r["policy"] == "snapkv"]
    for f, s in zip(full, snap):
        assert isinstance(f["prediction"], str) and 1 <= f["stats"]["generated_tokens"] <= 4
        assert f["stats"]["prompt_tokens"] <= 384 - 16
        # Half of the compressed part is kept (within a token of rounding).
        assert abs(s["stats"]["kept"] - f["stats"]["kept"] / 2) <= 1


def test_share_shapes_pads_every_batch_to_the_longest_question(monkeypatch):
    """After `share_shapes(all samples)`, each batch is generated with `question_tokens` equal to the
    longest question of the run (in tokens), so tasks with short and long questions share programs."""
    import types

    import kvjax.engine
    from kvjax.eval.engine import _split_ids, make_generate_fn
    from kvjax.eval.tasks import generate_task
    from kvjax.models.model import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    short = generate_task("niah_single_1", tokenizer, 512, 2, seed=0)
    long = generate_task("niah_multikey_3", tokenizer, 512, 2, seed=0)  # UUID keys: long questions
    longest = max(len(q) for q in _split_ids(short + long, tokenizer, False)[1])
    assert longest > max(len(q) for q in _split_ids(short, tokenizer, False)[1])
    seen = []

    def fake_generate_settings(model, prompts, settings, **kw):
        seen.append(kw["question_tokens"])
        return [ValueError("not run") for _ in settings]

    monkeypatch.setattr(kvjax.engine, "generate_settings", fake_generate_settings)
    fn = make_generate_fn(types.SimpleNamespace(tokenizer=tokenizer, path="fake"))
    fn.many(short, settings=[types.SimpleNamespace(policy=None, budget=None, compression_ratio=None)],
            query_aware=False)
    fn.share_shapes(short + long, False)
    for batch in (short, long):
        fn.many(batch, settings=[types.SimpleNamespace(policy=None, budget=None, compression_ratio=None)],
                query_aware=False)
    assert seen == [0, longest, longest]


@pytest.mark.slow
def test_cli_cache_layout_ragged_gives_the_same_answers_in_fewer_bytes(tmp_path, capsys):
    """`--cache-layout ragged` reaches `kvjax.generate`: an adaptive budget (pyramidkv, fewer entries in
    upper layers) answers exactly as in the dense layout while its recorded decode cache is smaller."""
    from tiny_models import build_hf

    from kvjax.eval.cli import main

    model_dir = tmp_path / "model"
    build_hf("llama3", model_dir, vocab_size=2560, max_position_embeddings=1024, pad_token_id=0)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, model_dir / f.name)
    rows = {}
    for layout in ("dense", "ragged"):
        out = tmp_path / layout
        argv = ["--model", str(model_dir), "--tasks", "passkey", "--num-samples", "2", "--batch-size", "2",
                "--context-length", "384", "--policies", "pyramidkv", "--compression-ratios", "0.5",
                "--max-new-tokens", "4", "--cache-layout", layout, "--out", str(out), "--no-progress"]
        assert main(argv) == 0
        assert json.loads((out / "run_config.json").read_text())["cache_layout"] == layout
        rows[layout] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()
                        if json.loads(line)["policy"] == "pyramidkv"]
    assert len(rows["dense"]) == len(rows["ragged"]) == 2
    for d, r in zip(rows["dense"], rows["ragged"]):
        assert d["prediction"] == r["prediction"]
        assert r["stats"]["batch_cache_bytes"] < d["stats"]["batch_cache_bytes"]
    with pytest.raises(SystemExit):  # a folder of ragged results is not resumed as dense
        main(argv[:-5] + ["--cache-layout", "dense", "--out", str(tmp_path / "ragged"), "--no-progress"])
    assert "cache_layout: 'ragged' there, 'dense' now" in capsys.readouterr().err
