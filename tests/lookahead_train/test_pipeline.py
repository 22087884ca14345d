"""Pipeline plumbing: multi-host initialisation only when the environment says so; a workdir
refuses to resume under another config, and a recorded run's resumes under its own."""

import dataclasses
import json
import pathlib
import types

import jax
import numpy as np
import pytest

from kvjax.training import learning_rate
from train_lookahead import pipeline
from train_lookahead.config import RunConfig


@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({"TPU_WORKER_HOSTNAMES": "10.0.0.2"}, False),  # a single-host TPU VM
    ({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5"}, True),  # a v5e-16 slice: 4 workers
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}, True),
])
def test_distributed_initialize_only_for_multi_host(monkeypatch, env, expected):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    assert pipeline.maybe_initialize_distributed(env) is expected
    assert len(calls) == int(expected)


def test_workdir_refuses_another_config(tmp_path):
    cfg = RunConfig()
    pipeline._check_workdir_config(tmp_path, cfg)
    pipeline._check_workdir_config(tmp_path, cfg)  # the same config resumes
    pipeline._check_workdir_config(tmp_path, dataclasses.replace(cfg, export=dataclasses.replace(
        cfg.export, eval_scores="s.json")))  # export settings may change
    other = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, learning_rate=1e-3))
    with pytest.raises(ValueError, match="optim"):
        pipeline._check_workdir_config(tmp_path, other)
    # a workdir started before a field existed resumes under its default, and not under another value
    old = json.loads((tmp_path / "config.json").read_text())
    del old["lookahead"]["span"], old["train"]["loss"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    pipeline._check_workdir_config(tmp_path, cfg)
    with pytest.raises(ValueError, match="train"):
        pipeline._check_workdir_config(tmp_path, dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, loss="topk")))


RECORDED = pathlib.Path(__file__).resolve().parents[2] / "eval" / "lookahead_smollm2" / "export"


def test_a_recorded_run_resumes_under_its_config_and_schedule(tmp_path):
    """A recorded run's workdir config (eval/lookahead_smollm2: train_config.json is its config.json) is
    accepted on resume, and kvjax.training's schedule gives the learning rates its log recorded."""
    recorded = json.loads((RECORDED / "train_config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    cfg = RunConfig.from_dict(recorded)
    pipeline._check_workdir_config(tmp_path, cfg)  # raises if any section (optim included) reads differently
    rows = [json.loads(line) for line in (RECORDED / "log.jsonl").read_text().splitlines()]
    schedule = learning_rate(cfg.optim, cfg.train.steps)
    assert len(rows) > 10
    for row in rows:
        np.testing.assert_allclose(float(schedule(row["step"] - 1)), row["lr"], rtol=1e-6, atol=1e-12)


def test_a_batch_that_does_not_split_over_the_mesh_fails_before_any_work(tmp_path):
    cfg = RunConfig.from_dict({"train": {"batch_size": 3}, "mesh": {"data": 2}})
    with pytest.raises(ValueError, match=r"train\.batch_size=3 must be divisible by the mesh's data axis \(2\)"):
        pipeline.run(cfg, tmp_path)
    assert not (tmp_path / "targets").exists()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("train, order, init", [({"seed": 3}, 3, 3), ({"seed": 3, "init_seed": 5}, 3, 5),
                                                ({"init_seed": 0, "init_tokens": list(range(32))}, 0, 0)])
def test_batch_order_follows_seed_and_initialisation_init_seed(monkeypatch, tmp_path, train, order, init):
    """`train.seed` shuffles the batches; the adapter starts from `train.init_seed` when set, else from `seed`,
    and from `train.init_tokens`' embeddings when given."""
    seen = {}
    monkeypatch.setattr(pipeline, "load_frozen", lambda cfg, mesh: types.SimpleNamespace(config=None))
    monkeypatch.setattr(pipeline, "check_positions", lambda *a: None)
    monkeypatch.setattr(pipeline, "generate_targets", lambda *a, **k: tmp_path)
    monkeypatch.setattr(pipeline, "TargetRecords", lambda folder: list(range(16)))
    monkeypatch.setattr(pipeline, "train_dataset", lambda records, **k: seen.setdefault("order", k["seed"]))

    def init_adapter(model, config, key, token_ids=None):
        seen["init"], seen["tokens"] = key, token_ids
        raise _Stop

    monkeypatch.setattr(pipeline, "init_adapter", init_adapter)
    with pytest.raises(_Stop):
        pipeline.run(RunConfig.from_dict({"train": {"batch_size": 8, **train}}), tmp_path / "work")
    assert seen["order"] == order
    assert seen["tokens"] == (tuple(train["init_tokens"]) if "init_tokens" in train else None)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(seen["init"])),
                                  np.asarray(jax.random.key_data(jax.random.PRNGKey(init))))
