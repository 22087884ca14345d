"""`python -m kvjax.eval` for its user: positions checked before any work, Ctrl-C ends with the
command that resumes, policy spellings recorded under one name, what a score means."""

import json
import shlex
import subprocess
import sys

import jax
import pytest

import kvjax.eval.engine
from kvjax.eval.cli import main
from kvjax.eval.report import SCORE_NOTE
from test_eval_cli import REPO


def test_context_length_beyond_the_model_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    def no_loading(spec):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(kvjax.eval.engine, "load", no_loading)
    out = tmp_path / "run"
    limit = json.loads((kvjax.eval.engine.BUNDLED_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--context-length", str(limit + 1), "--out", str(out), "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--context-length {limit + 1}" in err and f"max_position_embeddings={limit}" in err
    assert not out.exists()  # no run_config.json, no folder
    with pytest.raises(SystemExit):
        main(["--niah-lengths", str(limit * 2), "--tasks", "niah_grid", "--out", str(out)])
    assert "--niah-lengths" in capsys.readouterr().err and not out.exists()


def test_ctrl_c_prints_the_resume_command_and_exits_130(tok, tmp_path, capsys):
    calls = []

    def interrupted(samples, *, policy, compression_ratio, budget, query_aware):
        calls.append(policy)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return [" ".join(s["answers"]) for s in samples]

    argv = ["--tasks", "niah_single_1", "--num-samples", "2", "--compression-ratios", "0.5",
            "--out", str(tmp_path), "--no-progress"]
    assert main(argv, generate_fn=interrupted, tokenizer=tok, policies=["snapkv"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resume with: python -m kvjax.eval" in err[0]
    assert shlex.split(err[0].split("resume with: ")[1])[3:] == argv
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2  # the full-cache batch is kept
    calls.clear()
    assert main(argv, generate_fn=interrupted, tokenizer=tok, policies=["snapkv"]) == 0
    assert calls == ["snapkv"]  # only the unfinished setting ran


def test_the_resume_command_names_the_implicit_out():
    from kvjax.eval.cli import resume_command

    assert resume_command(["--seed", "3"], "out/x") == "python -m kvjax.eval --seed 3 --out out/x"
    assert resume_command(["--out=o"], "o") == "python -m kvjax.eval --out=o"


def test_policy_spellings_are_recorded_under_the_preset_name(tok, tmp_path, capsys):
    def fake(samples, *, policy, compression_ratio, budget, query_aware):
        return ["?" for _ in samples]

    argv = ["--tasks", "vt", "--num-samples", "1", "--compression-ratios", "0.5", "--out", str(tmp_path),
            "--no-progress", "--policies", "SnapKV,snap_kv,KnormPress"]
    assert main(argv, generate_fn=fake, tokenizer=tok, policies=["snapkv", "knorm_kvpress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted({r["policy"] for r in rows}) == ["full", "knorm_kvpress", "snapkv"] and len(rows) == 3
    assert json.loads((tmp_path / "run_config.json").read_text())["policies"] == ["snapkv", "knorm_kvpress"]
    with pytest.raises(SystemExit):
        main(argv[:-1] + ["SnapKW"], generate_fn=fake, tokenizer=tok, policies=["snapkv", "knorm_kvpress"])
    assert "'SnapKW' (did you mean 'snapkv'?)" in capsys.readouterr().err


def test_what_a_score_is_is_said_in_help_table_and_results_md(tok, tmp_path, capsys):
    help_text = subprocess.run([sys.executable, "-m", "kvjax.eval", "--help"], capture_output=True, text=True,
                               cwd=REPO, timeout=120).stdout
    flat = " ".join(help_text.split())
    for phrase in ("mean per-sample score x 100", "avg = unweighted mean over the tasks", "'-' = not run"):
        assert phrase in flat

    def fake(samples, *, policy, compression_ratio, budget, query_aware):
        return [" ".join(s["answers"]) for s in samples]

    argv = ["--tasks", "vt", "--num-samples", "1", "--policies", "none", "--out", str(tmp_path), "--no-progress"]
    assert main(argv, generate_fn=fake, tokenizer=tok) == 0
    printed = capsys.readouterr().out
    md = (tmp_path / "results.md").read_text()
    for line in SCORE_NOTE:
        assert line in printed and line in md


def test_lookahead_options_change_the_adapters_inference_fields_only(tok, tmp_path, capsys):
    """--lookahead-option kernel=15 runs the same adapter weights with max pooling over 15 positions; the
    options are part of the run's identity, and names fixed at training are refused."""
    import numpy as np

    from kvjax.lookahead import load

    seen = []

    def fake(samples, *, policy, compression_ratio, budget, query_aware):
        if policy is not None and not isinstance(policy, str):
            seen.append(policy.adapter)
        return ["?" for _ in samples]

    argv = ["--tasks", "vt", "--num-samples", "1", "--compression-ratios", "0.5", "--out", str(tmp_path),
            "--no-progress", "--policies", "lookahead_kv"]
    assert main(argv + ["--lookahead-option", "kernel=15", "--lookahead-option", "gqa_reduce=max",
                        "--lookahead-option", "window=16", "--lookahead-option", "window_weight=0.5"],
                generate_fn=fake, tokenizer=tok) == 0
    bundled = load("bundled")
    (adapter,) = seen
    assert (adapter.config.kernel, adapter.config.gqa_reduce) == (15, "max") and bundled.config.kernel == 7
    assert (adapter.config.window, adapter.config.window_weight) == (16, 0.5) and bundled.config.window == 0
    assert adapter.config.n_tokens == bundled.config.n_tokens
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapter.params), jax.tree.leaves(bundled.params)))
    assert json.loads((tmp_path / "run_config.json").read_text())["lookahead_options"] == {
        "kernel": 15, "gqa_reduce": "max", "window": 16, "window_weight": 0.5}
    with pytest.raises(SystemExit):  # another kernel into the same folder: other results under the same name
        main(argv + ["--lookahead-option", "kernel=7"], generate_fn=fake, tokenizer=tok)
    assert "lookahead_options" in capsys.readouterr().err
    for bad, says in (("n_tokens=8", "NAME one of"), ("kernel=8", "must be odd"), ("kernel", "NAME=VALUE"),
                      ("window_weight=0", "window_weight must be a positive float"), ("window=-1", "window must be")):
        with pytest.raises(SystemExit):
            main(argv + ["--lookahead-option", bad], generate_fn=fake, tokenizer=tok)
        assert says in capsys.readouterr().err
