"""The cache each setting really used (`GenerateOutput.kept_peak`, `kept_mean`, bytes, budget
reached), against counts worked out from the policies' specs, and batch errors that name the row."""

import numpy as np
import pytest

import kvjax
import kvjax.engine
from kvjax import policies

RNG = np.random.RandomState(3)
N = 6  # generated tokens: the first from prefill, then N - 1 decode steps each writing one entry


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


def _run(model, prompts, **kw):
    return kvjax.generate(model, prompts, max_new_tokens=N, stop_tokens=[], **kw)


def _entry_bytes(model):
    cfg = model.config
    return cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize


def test_kept_peak_and_mean_follow_each_policys_schedule(stories):
    prompts = [[1] + RNG.randint(3, 512, n - 1).tolist() for n in (60, 45)]
    T = np.array([60, 45])
    steps = N - 1
    Setting = kvjax.engine.Setting
    full, snap, lazy = kvjax.engine.generate_settings(stories, prompts, [
        Setting(None), Setting(policies.get("snapkv_kvpress", window=8), compression_ratio=0.5),
        Setting(policies.get("lazy_eviction", window=20), budget=30)], max_new_tokens=N, stop_tokens=[])
    # full cache: the prompt, then one more entry per decode step; no budget applies
    np.testing.assert_allclose(full.kept_peak, T + steps)
    np.testing.assert_allclose(full.kept_mean, T + steps / 2)
    assert full.budget is None and full.budget_reached is None
    np.testing.assert_allclose(full.kv_bytes_peak, (T + steps) * _entry_bytes(stories))
    # prefill eviction to kvpress's int(T * (1 - r)) per row, then one more entry per step
    C = np.array([30, 22])
    assert snap.budget.tolist() == C.tolist() and snap.budget_reached.all()
    np.testing.assert_allclose(snap.kept_peak, C + steps)
    np.testing.assert_allclose(snap.kept_mean, C + steps / 2)
    np.testing.assert_allclose(snap.kv_bytes_mean, (C + steps / 2) * _entry_bytes(stories))
    # LazyEviction evicts only at steps that are multiples of its window: with window 20 it never
    # does within these answers, so it holds the whole prompt and the budget is never reached
    np.testing.assert_allclose(lazy.kept_peak, T + steps)
    np.testing.assert_allclose(lazy.kept_mean, T + steps / 2)
    assert lazy.budget.tolist() == [30, 30] and not lazy.budget_reached.any()


def test_a_row_too_short_for_the_policy_is_named(stories):
    prompts = [[1] + RNG.randint(3, 512, n - 1).tolist() for n in (200, 40, 300)]
    with pytest.raises(ValueError) as err:
        _run(stories, prompts, policy="SnapKV", compression_ratio=0.5)  # row 1 keeps 20 <= window 32
    msg = str(err.value)
    assert "row 1 (40 prompt tokens)" in msg and "'snapkv'" in msg and "compression_ratio=0.5" in msg
    with pytest.raises(ValueError) as err:
        _run(stories, prompts, policy="lazy_eviction", budget=100)  # below its 175-token window
    msg = str(err.value)
    assert "row 0 (200 prompt tokens)" in msg and "'lazy_eviction'" in msg and "budget=100" in msg
