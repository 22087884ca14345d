"""`python -m kvjax.eval` end to end in the fast set: the real engine and the bundled model, at a
tiny size (2 samples of one task at 512 tokens, one policy given in its paper spelling)."""

import json

import pytest

from kvjax.eval.engine import BUNDLED_MODEL_DIR
from kvjax.eval.report import UNREACHED_MARK


@pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").is_file(), reason="the bundled model is not shipped")
def test_cli_on_the_bundled_model(tmp_path, capsys):
    from kvjax.eval.cli import main

    out = tmp_path / "run"
    argv = ["--tasks", "niah_single_1", "--num-samples", "2", "--batch-size", "2", "--context-length", "512",
            "--policies", "LazyEviction", "--budgets", "200", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    settings = sorted((r["policy"], r["setting"]) for r in rows)
    assert settings == [("full", "full")] * 2 + [("lazy_eviction", "C=200")] * 2
    full = [r for r in rows if r["policy"] == "full"]
    lazy = [r for r in rows if r["policy"] == "lazy_eviction"]
    # the bundled model finds the needle at 512 tokens with the full cache (its card: 100 on niah_single_1)
    assert sum(r["score"] for r in full) / len(full) >= 0.5
    for f, z in zip(full, lazy):
        st = z["stats"]
        assert f["stats"]["prompt_tokens"] <= 512 and 1 <= st["generated_tokens"] <= 128
        # LazyEviction evicts every 175 generated tokens: these short answers end first, so its cache
        # holds the whole prompt, the budget is never reached, and it answers as the full cache does
        assert st["budget"] == 200 and st["budget_reached"] is False
        assert st["kept_peak"] >= st["kept_mean"] >= st["kept"] > 200
        assert st["kept_mean"] == f["stats"]["kept_mean"] and z["prediction"] == f["prediction"]
    header = printed.splitlines()[0].split()
    assert header[:3] == ["policy", "setting", "niah_single_1"] and "kept" in header
    assert f"C=200{UNREACHED_MARK}" in printed and f"{UNREACHED_MARK} lazy_eviction C=200" in printed
