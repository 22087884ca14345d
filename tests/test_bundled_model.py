"""The model shipped in kvjax/assets/model: complete and small, the same network under transformers,
its card's full-cache scores those of the recorded default run (eval/default), and (slow) it gives
the recorded answers again."""

import json
import pathlib
import re

import numpy as np
import pytest

from kvjax.eval.engine import BUNDLED_MODEL_DIR

RECORDED = pathlib.Path(__file__).resolve().parents[1] / "eval" / "default"
DEFAULT_SUITE = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                 "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt")

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").is_file(),
                                reason="the bundled model is not in this checkout")


def _recorded_full() -> list[dict]:
    rows = [json.loads(line) for line in (RECORDED / "results.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["policy"] == "full"]


def test_shipped_files_and_size():
    names = {p.name for p in BUNDLED_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md",
            "loss_curve.png"} <= names
    total = sum(p.stat().st_size for p in BUNDLED_MODEL_DIR.rglob("*") if p.is_file())
    assert total < 20 * 2**20, f"{total / 2**20:.1f} MiB"


def test_card_scores_are_the_recorded_default_run_and_at_least_90():
    card = (BUNDLED_MODEL_DIR / "MODEL_CARD.md").read_text()
    table = {t: float(v) for t, v in re.findall(r"^\| (\w+) \| \d+ \| ([\d.]+) \|$", card, re.M)}
    assert set(table) == set(DEFAULT_SUITE)
    per_task: dict[str, list[float]] = {}
    for r in _recorded_full():
        per_task.setdefault(r["task"], []).append(r["score"])
    for task, scores in per_task.items():
        assert table[task] == pytest.approx(100 * np.mean(scores), abs=0.051)
    assert np.mean(list(table.values())) >= 90


def test_same_logits_under_transformers():
    import torch
    from transformers import AutoModelForCausalLM

    import kvjax
    from kvjax.models import extend

    model = kvjax.load_model(BUNDLED_MODEL_DIR)
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, torch_dtype=torch.float32).eval()
    ids = model.tokenizer("One of the special magic numbers for quiet-river is: 4821937. What is it?")["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(extend(model.params, model.config, None, np.asarray([ids]), np.arange(len(ids))[None],
                             fresh=True)[0])
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())


@pytest.mark.slow
def test_gives_the_recorded_full_cache_answers(tmp_path):
    """Two samples of every task, full cache, as `python -m kvjax.eval` ran them: the same predictions."""
    from kvjax.eval import cli

    config = json.loads((RECORDED / "run_config.json").read_text())
    cli.main(["--policies", "none", "--num-samples", "2", "--out", str(tmp_path), "--no-progress",
              "--context-length", str(config["context_length"]), "--seed", str(config["seed"])])
    again = {r["sample_id"]: r["prediction"] for r in map(json.loads, (tmp_path / "results.jsonl").open())}
    recorded = {r["sample_id"]: r["prediction"] for r in _recorded_full() if r["sample_id"] in again}
    assert len(again) == 2 * len(DEFAULT_SUITE) and recorded == again
