"""`python -m train_lookahead` end to end on the tiny smoke config: targets, a few steps, export;
the exported adapter loads with kvjax.lookahead.load; re-running resumes (nothing is redone)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import kvjax
from kvjax.eval.engine import BUNDLED_MODEL_DIR
from kvjax.lookahead import init_adapter, load
from train_lookahead.config import RunConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "lookahead_smoke.yaml"


def cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "train_lookahead", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=900, cwd=REPO)


@pytest.mark.slow
def test_smoke_run_end_to_end_and_resume(tmp_path):
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"niah_single_1 C=64": 0.75}))
    work = tmp_path / "run"
    out = cli("--config", SMOKE, "--workdir", work, "--no-progress", "--eval-scores", scores)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = RunConfig.from_yaml(SMOKE)
    manifest = json.loads((work / "targets" / "manifest.json").read_text())
    assert manifest["records"] + manifest["skipped_long"] == cfg.data.sources[0].num_samples
    rows = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, cfg.train.steps + 1))
    export = work / "export"
    card = (export / "README.md").read_text()
    assert "--config" in card and f"steps: {cfg.train.steps}" in card and "0.75" in card
    assert (export / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = RunConfig.from_dict(json.loads((export / "train_config.json").read_text()))
    assert saved.export.eval_scores == str(scores) and dataclasses.replace(saved, export=cfg.export) == cfg
    model = kvjax.load_model(BUNDLED_MODEL_DIR)
    adapter = load(export, model=model)
    assert adapter.config == cfg.lookahead
    start = init_adapter(model, cfg.lookahead, jax.random.PRNGKey(cfg.train.seed))
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
             zip(jax.tree.leaves(adapter.params), jax.tree.leaves(start.params))]
    assert max(moved) > 0  # trained away from the initialisation
    stamp = (work / "targets" / "chunk_00000" / "target.npy").stat().st_mtime_ns
    again = cli("--config", SMOKE, "--workdir", work, "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (work / "targets" / "chunk_00000" / "target.npy").stat().st_mtime_ns == stamp
    again_rows = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    assert again_rows == rows  # nothing retrained
