"""kvjax.training's loop on one device with batches by step (as the bundled model trains), its optimizer
schedule for each entry point's configs, and HF export of trained params."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
from kvjax.models import extend
from kvjax.models.config import ModelConfig
from kvjax.models.export import init_params, save_hf
from kvjax.training import OptimConfig, bundled, learning_rate, read_log, train, warmup_steps
from kvjax.training.bundled.config import BundledOptim

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_ids=(2,))


def _batches(step):
    """Counting sequences: token t+1 follows token t (mod 29), offset by the step."""
    rng = np.random.RandomState(step)
    start = rng.randint(3, 32, (4, 1))
    tokens = (3 + (start - 3 + np.arange(16)) % 29).astype(np.int32)
    return {"tokens": tokens, "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (4, 16)).copy()}


def _loss(params, frozen, batch):
    logits, _, _ = extend(params, CFG, None, batch["tokens"], batch["positions"], fresh=True)
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    nll = -jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)
    return nll.mean(), {"last_token_loss": nll[:, -1].mean()}


def test_loss_decreases(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    before = float(_loss(params, None, _batches(999))[0])
    trained, steps = train(_loss, params, None, _batches, steps=40, optim=OptimConfig(learning_rate=1e-2),
                           workdir=tmp_path, checkpoint_every=20, log_every=10)
    assert steps == 40
    after = float(_loss(trained, None, _batches(999))[0])
    assert after < 0.5 * before
    rows = read_log(tmp_path)
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    assert set(rows[0]) == {"step", "loss", "grad_norm", "last_token_loss", "lr", "seconds"}  # the loss's metrics too
    assert rows[-1]["lr"] < rows[0]["lr"]  # the cosine decays


def test_a_data_iterator_without_a_position_is_refused(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match="data must be a function of the step or an iterable whose iterator has"):
        train(_loss, params, None, [_batches(0)] * 3, steps=3, optim=OptimConfig(), workdir=tmp_path)


# (config, warmup steps): the warmup every recorded phase of the bundled model ran with
BUNDLED_WARMUP = [("bundled_model", 39), ("bundled_model_long", 44), ("bundled_model_3", 30), ("bundled_model_4", 40)]


@pytest.mark.parametrize("name, warmup", BUNDLED_WARMUP)
def test_bundled_configs_keep_their_learning_rate_schedule(name, warmup):
    """The shared schedule gives each shipped bundled config the warmup its recorded run had (the former
    bundled loop's max(1, int(steps x warmup_fraction))), then the cosine to final_fraction x the rate."""
    optim = bundled.load_config(CONFIGS / f"{name}.yaml").optim
    assert warmup_steps(optim, optim.steps) == warmup
    lr = learning_rate(optim, optim.steps)
    assert float(lr(0)) == 0.0 and float(lr(warmup - 1)) < optim.learning_rate
    np.testing.assert_allclose(float(lr(warmup)), optim.learning_rate, rtol=1e-6)
    np.testing.assert_allclose(float(lr(optim.steps)), optim.learning_rate * optim.final_fraction, rtol=1e-5)


def test_each_entry_point_keeps_its_optimizer_defaults():
    from train_lookahead.config import OptimSection, RunConfig

    assert (OptimConfig().learning_rate, OptimConfig().final_fraction) == (3e-4, 0.1)  # the bundled recipe's
    section = RunConfig().optim
    assert isinstance(section, OptimSection) and isinstance(section, OptimConfig)
    assert (section.learning_rate, section.final_fraction) == (2e-4, 0.0)  # policies.md §11.4
    with pytest.raises(ValueError, match=r"optim\.steps must be an int >= 1, got 0"):
        BundledOptim(steps=0)
    # a 3-step run (configs/lookahead_smoke.yaml) has no warmup: its first step already learns
    assert warmup_steps(section, 3) == 0
    np.testing.assert_allclose(float(learning_rate(section, 3)(0)), section.learning_rate, rtol=1e-6)


def test_interrupted_run_resumes_to_the_same_params(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    optim = OptimConfig(learning_rate=1e-2)
    straight, _ = train(_loss, params, None, _batches, steps=6, optim=optim, workdir=tmp_path / "a", checkpoint_every=2)
    first, done = train(_loss, params, None, _batches, steps=6, optim=optim, workdir=tmp_path / "b",
                        checkpoint_every=2, max_seconds=0)
    assert done == 1  # interrupted after the first step, with a checkpoint
    resumed, done = train(_loss, params, None, _batches, steps=6, optim=optim, workdir=tmp_path / "b",
                          checkpoint_every=2)
    assert done == 6
    for x, y in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_resume_logs_each_step_once(tmp_path):
    """A run killed after logging steps past its last checkpoint redoes them; the log keeps one row each."""
    import json
    import shutil

    params = init_params(CFG, jax.random.PRNGKey(0))
    optim = OptimConfig(learning_rate=1e-2)
    train(_loss, params, None, _batches, steps=6, optim=optim, workdir=tmp_path, checkpoint_every=2, log_every=1)
    shutil.rmtree(tmp_path / "checkpoints" / "6")  # as if killed after logging steps 5 and 6
    train(_loss, params, None, _batches, steps=6, optim=optim, workdir=tmp_path, checkpoint_every=2, log_every=1)
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    train(_loss, params, None, _batches, steps=2, optim=OptimConfig(), workdir=tmp_path, checkpoint_every=1)
    for f in (tmp_path / "checkpoints").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="could not be restored"):
        train(_loss, params, None, _batches, steps=4, optim=OptimConfig(), workdir=tmp_path, checkpoint_every=1)


def test_export_round_trips_through_load_model_and_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    params = init_params(CFG, jax.random.PRNGKey(1), std=0.2)
    save_hf(tmp_path, params, CFG)
    model = kvjax.load_model(tmp_path)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = _batches(0)["tokens"][:1]
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(extend(model.params, model.config, None, tokens, np.arange(16)[None], fresh=True)[0])
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())
