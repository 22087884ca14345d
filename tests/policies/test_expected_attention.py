"""ExpectedAttention: scores and kept sets against the NumPy reference (GQA 8/2, padded batch of 3)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from pol_helpers import HKV, make_inputs
from pol_scorers_ref import check_kept, expected_reference, expected_scores

from kvjax.policies import Ada, ExpectedAttention, get


@functools.cache
def inputs(seed=0, lengths=(29, 17, 23)):
    return make_inputs(seed, lengths=lengths, window=8, num_layers=2, q_scale=1.0)


VARIANTS = [
    ExpectedAttention(n_future_positions=16),
    ExpectedAttention(n_future_positions=5, use_covariance=False),
    ExpectedAttention(n_future_positions=16, use_vnorm=False),
    ExpectedAttention(n_future_positions=16, epsilon=1e-2),
]


@pytest.mark.parametrize("policy", VARIANTS, ids=["default", "no-cov", "no-vnorm", "eps"])
def test_scores_equal_reference(policy):
    inp = inputs()
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=10)
    s = np.asarray(jax.jit(policy.score, static_argnums=0)(plan, inp.cache, inp.obs).scores)
    for b, T in enumerate(inp.lengths):
        for l in range(inp.num_layers):
            want = expected_scores(policy, inp, l, b, T)
            np.testing.assert_allclose(s[l, b, :, policy.n_sink:T], want[:, policy.n_sink:], rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize(
    "policy,budget,ratio",
    [
        (ExpectedAttention(n_future_positions=16), 10, None),
        (get("expected_attention_kvpress", n_future_positions=16), None, 0.5),
        (get("ada_expected_attention_kvpress", n_future_positions=16), None, 0.75),
        (get("ada_expected_attention", n_future_positions=16), 9, None),
    ],
    ids=["paper", "kvpress", "ada-kvpress", "ada-paper"],
)
def test_kept_sets_equal_reference(policy, budget, ratio):
    inp = inputs()
    _, keep = check_kept(policy, inp, expected_reference(policy, inp, budget, ratio), budget, ratio)
    assert keep[:, :, :, :4].all()  # the sinks


def test_presets_and_errors():
    p = get("expected_attention")
    assert (p.n_future_positions, p.n_sink, p.use_covariance, p.use_vnorm, p.epsilon) == (512, 4, True, True, 0.0)
    a = get("ada_expected_attention_kvpress")
    assert (a.epsilon, a.allocator, a.rule, a.query_aware) == (1e-2, Ada(alpha=0.2, rule="kvpress"), "kvpress", False)
    with pytest.raises(ValueError, match="n_future_positions"):
        ExpectedAttention(n_future_positions=0)
    with pytest.raises(ValueError, match="epsilon"):
        ExpectedAttention(epsilon=-1.0)
    with pytest.raises(TypeError, match="use_covariance"):
        ExpectedAttention(use_covariance=1)
    with pytest.raises(ValueError, match="n_sink=4"):
        ExpectedAttention().plan((4, 9), 2, HKV, compression_ratio=0.5)
