"""`python -m kvjax.eval`: options, config files, validation messages, a full run with a fake model, resume."""

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

from kvjax.eval.cli import DEFAULTS, build_parser, main, resolve
from kvjax.eval.tasks import SUITES

REPO = pathlib.Path(__file__).resolve().parents[2]
POLICIES = ["h2o", "snapkv"]


def _resolve(argv):
    parser = build_parser()
    return resolve(parser.parse_args(argv), parser, POLICIES)


def test_defaults_match_configs_eval_default():
    assert yaml.safe_load((REPO / "configs" / "eval_default.yaml").read_text()) == DEFAULTS


def test_no_arguments_means_every_policy_at_four_ratios_on_the_default_suite():
    cfg = _resolve([])
    assert cfg["tasks"] == SUITES["default"] and cfg["policies"] == POLICIES
    assert cfg["compression_ratios"] == [0.25, 0.5, 0.75, 0.875] and cfg["model"] == "bundled"
    assert cfg["query_aware"] is False
    assert cfg["out"] == str(pathlib.Path("out/eval/bundled_L1024_query-agnostic_seed42"))


def test_policies_none_is_the_full_cache_alone():
    assert _resolve(["--policies", "none"])["policies"] == []
    assert _resolve(["--policies", "all"])["policies"] == POLICIES


def test_help_documents_every_option():
    result = subprocess.run([sys.executable, "-m", "kvjax.eval", "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0
    for flag in ("--model", "--tasks", "--policies", "--compression-ratios", "--budgets", "--context-length",
                 "--num-samples", "--seed", "--out", "--query-aware", "--config", "--data", "--list"):
        assert flag in result.stdout
    assert "resumes" in result.stdout and "results.jsonl" in result.stdout


def test_unknown_task_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--tasks", "niah_single_1,bogus"], generate_fn=lambda *a, **k: [], policies=POLICIES)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown task(s) 'bogus'" in err and "Valid tasks:" in err
    assert "niah_single_1" in err and "vt" in err and "longbench/qasper" in err


def test_unknown_policy_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--policies", "snapkv", "magic"], generate_fn=lambda *a, **k: [], policies=POLICIES)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown policy(ies) 'magic'" in err and "Valid policies: h2o, snapkv" in err


def test_config_file_then_command_line(tmp_path):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("context_length: 512\nnum_samples: 3\ntasks: [vt]\npolicies: [h2o]\n")
    cfg = _resolve(["--config", str(cfg_path), "--context-length", "600", "--budgets", "64,128"])
    assert (cfg["context_length"], cfg["num_samples"], cfg["tasks"], cfg["policies"]) == (600, 3, ["vt"], ["h2o"])
    assert cfg["budgets"] == [64, 128] and cfg["compression_ratios"] == []
    assert _resolve(["--config", "smoke"])["tasks"] == ["niah_single_1", "vt"]  # by name, from configs/
    cfg_path.write_text("colour: red\n")
    with pytest.raises(SystemExit):
        _resolve(["--config", str(cfg_path)])
    with pytest.raises(SystemExit):
        _resolve(["--compression-ratios", "1.5"])
    with pytest.raises(SystemExit):
        _resolve(["--data", "nopath"])


def test_full_run_with_fake_model_then_resume(tok, tmp_path, capsys):
    calls = []

    def fake(samples, *, policy, compression_ratio, budget, query_aware):
        calls.append((policy, compression_ratio, len(samples), query_aware))
        return [" ".join(s["answers"]) if policy is None else "?" for s in samples]

    argv = ["--tasks", "niah_single_1", "vt", "qa_1", "--num-samples", "2", "--compression-ratios", "0.5",
            "--out", str(tmp_path), "--no-progress", "--query-aware"]
    assert main(argv, generate_fn=fake, tokenizer=tok, policies=POLICIES) == 0
    out = capsys.readouterr()
    assert "full    full" in out.out and "100.00" in out.out and "skipping qa_1" in out.err
    assert len(calls) == 2 * 3 and all(c[3] for c in calls)  # 2 tasks x (full + 2 policies), query-aware
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 3 * 2
    for name in ("results.md", "results.csv", "metrics.json", "score_vs_compression.png", "run_config.json"):
        assert (tmp_path / name).is_file()
    assert "qa_1" in (tmp_path / "results.md").read_text()
    summary = json.loads((tmp_path / "metrics.json").read_text())["table"]
    assert summary["rows"][0] == ["full", "full", 100.0, 100.0, 100.0]
    calls.clear()
    assert main(argv, generate_fn=fake, tokenizer=tok, policies=POLICIES) == 0
    assert calls == []  # everything was finished
    with pytest.raises(SystemExit):
        main(argv + ["--context-length", "2048"], generate_fn=fake, tokenizer=tok, policies=POLICIES)
    assert "holds results of a different run" in capsys.readouterr().err


def test_list(capsys):
    assert main(["--list"], policies=POLICIES) == 0
    text = capsys.readouterr().out
    assert "niah_multiquery" in text and "longbench/lcc" in text and "h2o, snapkv" in text


def test_policies_default_is_the_recorded_default_group_and_all_adds_the_rest():
    from kvjax.eval.cli import DEFAULT_POLICIES

    parser = build_parser()
    valid = sorted(DEFAULT_POLICIES + ["kvzip", "expected_attention"])
    default = resolve(parser.parse_args([]), parser, valid)["policies"]
    assert default == sorted(DEFAULT_POLICIES) and "kvzip" not in default
    every = resolve(parser.parse_args(["--policies", "all"]), parser, valid)["policies"]
    assert every == valid
    both = resolve(parser.parse_args(["--policies", "kvzip", "default"]), parser, valid)["policies"]
    assert both[0] == "kvzip" and set(both) == set(DEFAULT_POLICIES) | {"kvzip"}


def test_prefill_chunk_reaches_every_policy_setting_and_skips_unsupported_policies(tok, tmp_path, capsys):
    cfg = _resolve(["--prefill-chunk", "64"])
    assert cfg["prefill_chunk"] == 64 and cfg["out"].endswith("_chunk64")
    with pytest.raises(SystemExit):
        _resolve(["--prefill-chunk", "0"])
    assert "--prefill-chunk must be positive" in capsys.readouterr().err
    calls = []

    def fake(samples, *, policy, compression_ratio, budget, query_aware, prefill_chunk=None):
        calls.append((policy, prefill_chunk))
        return [" ".join(s["answers"]) for s in samples]

    argv = ["--tasks", "vt", "--num-samples", "1", "--compression-ratios", "0.5", "--policies", "snapkv", "kvzip",
            "--prefill-chunk", "64", "--out", str(tmp_path), "--no-progress"]
    assert main(argv, generate_fn=fake, tokenizer=tok, policies=["snapkv", "kvzip"]) == 0
    assert set(calls) == {(None, None), ("snapkv", 64)} and len(calls) == 2
    assert "skipping kvzip: no chunked prefill" in capsys.readouterr().err
