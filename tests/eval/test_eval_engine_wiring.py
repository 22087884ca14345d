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
