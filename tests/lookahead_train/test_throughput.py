"""train_lookahead.throughput: it times the recipe's own stages on the slice it says it ran."""

import json

import pytest

from kvjax.training import read_log
from train_lookahead import throughput
from train_lookahead.config import RunConfig
from train_lookahead.targets import TargetRecords

CONF = {"model": {"path": "bundled"}, "lookahead": {"n_tokens": 4, "rank": 2},
        "data": {"max_prompt_tokens": 256, "sources": [{"kind": "synthetic", "tasks": ["niah_single_1"],
                                                        "context_length": 256, "num_samples": 512}]},
        "targets": {"max_response_tokens": 8, "batch_size": 2},
        "train": {"steps": 300, "batch_size": 2, "checkpoint_every": 25, "log_every": 5},
        "mesh": {"data": 1, "model": 1}}


def test_throughput_runs_the_asked_slice_and_reports_its_rates(tmp_path):
    cfg = RunConfig.from_dict(CONF)
    m = throughput.measure(cfg, tmp_path, chunks=2, steps=3)
    # the slice: one compile chunk, 2 timed chunks of targets.batch_size prompts, then exactly 3 steps
    assert len(TargetRecords(tmp_path / "compile" / "targets")) == 2
    assert len(TargetRecords(tmp_path / "timed" / "targets")) == 4
    assert [r["step"] for r in read_log(tmp_path / "timed")] == [1, 2, 3]
    assert m["timed_steps"] == 1 and m["chunks"] == 2
    assert m["steps_per_s"] == pytest.approx(1 / m["step_s"]) and m["examples_per_s"] == pytest.approx(2 / m["step_s"])
    assert m["prompts_per_s"] == pytest.approx(2 / m["chunk_s"])
    assert m["first_step_s"] > m["step_s"] > 0  # the first step compiles
    text = throughput.report([m], "x.yaml")
    assert f"{m['steps_per_s']:.4f} steps/s" in text and "(mean of 2)" in text
    with pytest.raises(ValueError, match="steps >= 2"):
        throughput.measure(cfg, tmp_path / "again", chunks=1, steps=1)


def test_cli_writes_the_report_and_its_numbers(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(CONF))  # JSON is YAML
    out = tmp_path / "r" / "throughput.md"
    assert throughput.main(["--config", str(config), "--chunks", "1", "--steps", "2", "--out", str(out)]) == 0
    numbers = json.loads(out.with_suffix(".json").read_text())
    assert numbers["config"] == str(config) and numbers["timed_steps"] == 1
    assert out.read_text().startswith("# LookaheadKV training throughput")


def test_both_prompt_cache_settings_side_by_side(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(CONF))
    out = tmp_path / "both.md"
    assert throughput.main(["--config", str(config), "--chunks", "1", "--steps", "2", "--prompt-cache", "both",
                            "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert [r["prompt_cache"] for r in runs] == [False, True]
    # the cached run trained on records that carry the prefill's cache; the other on records without
    assert TargetRecords(tmp_path / "w" / "cache" / "timed" / "targets")[0]["prompt_k"].ndim == 4
    assert "prompt_k" not in TargetRecords(tmp_path / "w" / "prefill" / "timed" / "targets")[0]
    text = out.read_text()
    ratio = runs[0]["step_s"] / runs[1]["step_s"]
    assert "| stored | train" in text and "| prefilled each step | train" in text and f"**{ratio:.1f}x**" in text
