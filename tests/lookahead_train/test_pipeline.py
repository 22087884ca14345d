"""Pipeline plumbing: multi-host initialisation only when the environment says so; a workdir
refuses to resume under another config."""

import dataclasses

import jax
import pytest

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
