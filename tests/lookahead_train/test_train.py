"""kvjax.training's loop as train_lookahead runs it (grain data, sharded frozen weights): a run
interrupted after step k and resumed ends with the parameters of an uninterrupted run (same data
order), on 1 device and on a 4 (data) x 2 (model) mesh of 8 fake CPU devices; and 8 devices equal
1 device within float tolerance. The loss is kvjax.lookahead.loss_fn
(via train_lookahead.loss) on the real stories260K model."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import kvjax
from kvjax.lookahead import LookaheadConfig, init_adapter
from kvjax.models.loading import param_shardings
from kvjax.sharding import make_mesh
from kvjax.training import read_log, train
from train_lookahead.config import OptimSection
from train_lookahead.data import ROW_AXES, train_dataset
from train_lookahead.loss import lookahead_loss

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS, KILL_AFTER, T = 5, 3, 16
LA = LookaheadConfig(n_tokens=4, rank=2, alpha=4.0)


def records(L=5, H=8, n=12, seed=0):
    """Prompts of stories260K token ids with sharp random targets [L, Hq, T_i]."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(6, T + 1))
        tokens = np.concatenate([[1], rng.integers(3, 512, t - 1)]).astype(np.int32)
        out.append({"tokens": tokens, "target": rng.dirichlet(np.full(t, 0.3), size=(L, H)).astype(np.float32)})
    return out


def run(stories_path, workdir, data=1, model=1, stop_after=None, hard=False):
    """Trains STEPS steps (batch 8, checkpoint every 2). stop_after=k interrupts after step k:
    KeyboardInterrupt, or with `hard` os._exit(9) (as a kill: no cleanup, pending saves lost)."""
    mesh = make_mesh(data, model, devices=jax.devices()[: data * model])
    m = kvjax.load_model(stories_path, mesh=mesh)
    adapter = init_adapter(m, LA, jax.random.PRNGKey(0))
    ds = train_dataset(records(), batch_size=8, seed=3, max_prompt_tokens=T)

    def on_step(step, row):
        if step == stop_after:
            if hard:
                os._exit(9)
            raise KeyboardInterrupt

    return train(lookahead_loss(m.config, LA), adapter.params, m.params, ds, steps=STEPS,
                 optim=OptimSection(learning_rate=1e-2, warmup_fraction=0.2), workdir=workdir, mesh=mesh,
                 frozen_shardings=param_shardings(m.config, mesh), row_axes=ROW_AXES, checkpoint_every=2,
                 log_every=1, on_step=on_step, progress=False)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def one_device(stories_path, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    return (*run(stories_path, workdir), workdir)


def test_training_changes_the_adapter_and_lowers_the_loss(one_device):
    params, steps, workdir = one_device
    assert steps == STEPS
    rows = read_log(workdir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert np.abs(np.asarray(params["embeddings"])).sum() > 0


def test_interrupted_run_resumes_to_the_same_params_on_one_device(stories_path, tmp_path, one_device):
    with pytest.raises(KeyboardInterrupt):
        run(stories_path, tmp_path, stop_after=KILL_AFTER)
    params, steps = run(stories_path, tmp_path)
    assert steps == STEPS
    for a, b in zip(leaves(params), leaves(one_device[0])):
        np.testing.assert_array_equal(a, b)
    assert [r["step"] for r in read_log(tmp_path)] == list(range(1, STEPS + 1))  # each step logged once


@pytest.mark.slow
def test_eight_devices_resume_exactly_and_match_one_device(stories_path, tmp_path, one_device):
    full, _ = run(stories_path, tmp_path / "full", data=4, model=2)
    with pytest.raises(KeyboardInterrupt):
        run(stories_path, tmp_path / "cut", data=4, model=2, stop_after=KILL_AFTER)
    resumed, steps = run(stories_path, tmp_path / "cut", data=4, model=2)
    assert steps == STEPS
    for a, b, c in zip(leaves(resumed), leaves(full), leaves(one_device[0])):
        np.testing.assert_array_equal(a, b)
        # sharded reductions sum in another order; Adam's g / sqrt(v) turns those float32 rounding
        # differences into up to ~1e-4 of the lr-1e-2 updates (5 steps move params by up to 5e-2)
        np.testing.assert_allclose(a, c, rtol=1e-3, atol=2e-4)


@pytest.mark.slow
def test_hard_kill_resumes_exactly(stories_path, tmp_path, one_device):
    """A process killed by os._exit (no cleanup, no final save) right after step k, then re-run."""
    code = textwrap.dedent(f"""
        import pathlib, sys
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        import test_train
        test_train.run(pathlib.Path({str(stories_path)!r}), {str(tmp_path)!r}, stop_after={KILL_AFTER}, hard=True)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == 9, killed.stderr[-2000:]
    assert [r["step"] for r in read_log(tmp_path)] == list(range(1, KILL_AFTER + 1))
    params, steps = run(stories_path, tmp_path)
    assert steps == STEPS
    for a, b in zip(leaves(params), leaves(one_device[0])):
        np.testing.assert_array_equal(a, b)
    assert [r["step"] for r in read_log(tmp_path)] == list(range(1, STEPS + 1))
