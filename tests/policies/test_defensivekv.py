"""DefensiveKV / Layer-DefensiveKV against a NumPy transcription of the authors' score() (GQA 8/2, padded batch)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from pol_helpers import HKV, make_inputs
from pol_scorers_ref import check_kept, defensive_layer, defensive_reference

from kvjax.policies import DefensiveKV, get


@functools.cache
def inputs(seed=0, lengths=(29, 17, 23), q_scale=2.5):
    return make_inputs(seed, lengths=lengths, window=8, num_layers=3, q_scale=q_scale)


@pytest.mark.parametrize("layer_wise", [False, True], ids=["defensivekv", "layer_defensivekv"])
@pytest.mark.parametrize(
    "kw,budget,ratio",
    [
        (dict(window=4, kernel=5), 9, None),
        (dict(window=6, kernel=3), None, 0.5),
        (dict(window=4, kernel=1, rule="kvpress"), None, 0.8),  # n_kept <= w in the short row: most recent kept
        (dict(window=5, kernel=5), 12, None),
    ],
    ids=["w4k5-C9", "w6k3-r0.5", "w4k1-r0.8", "w5k5-C12"],
)
@pytest.mark.parametrize("seed,q_scale", [(0, 2.5), (3, 0.7), (0, 6.0)], ids=["peaked", "flat", "sharp"])
def test_kept_sets_equal_reference(layer_wise, kw, budget, ratio, seed, q_scale):
    inp = inputs(seed, q_scale=q_scale)
    policy = DefensiveKV(layer_wise=layer_wise, **kw)
    _, keep = check_kept(policy, inp, defensive_reference(policy, inp, budget, ratio), budget, ratio)
    total = keep.sum(-1)
    for b, T in enumerate(inp.lengths):  # the budget is spent exactly: per layer, or over all layers
        n_kept = int(T * (1 - ratio)) if ratio is not None else budget
        if n_kept <= kw["window"] or n_kept >= T:
            continue
        per = HKV * (inp.num_layers if layer_wise else 1)
        want = int(T * (1 - ratio) * per) if ratio is not None else per * budget
        got = total[:, b].sum() if layer_wise else total[:, b].sum(-1)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("window,kernel", [(4, 5), (6, 3)])
def test_scores_and_stage_one_equal_reference(window, kernel):
    """The defensive aggregate times the head share of projected norms, slot by slot, and the forced
    (window + stage-1) sets."""
    inp = inputs(0, q_scale=6.0)
    policy = DefensiveKV(window=window, kernel=kernel)
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=10)
    scored = policy.score(plan, inp.cache, inp.obs)
    s, prot = np.asarray(scored.scores), np.asarray(scored.protected)
    for b, T in enumerate(inp.lengths):
        for l in range(inp.num_layers):
            want, forced = defensive_layer(policy, inp, l, b, T, 10)
            np.testing.assert_allclose(s[l, b, :, : T - window], want, rtol=1e-4, atol=1e-9)
            for h in range(HKV):
                assert set(np.nonzero(prot[l, b, h])[0].tolist()) == forced[h]


def test_presets_and_errors():
    d, lw = get("defensivekv"), get("layer_defensivekv")
    assert (d.window, d.kernel, d.layer_wise) == (32, 5, False)
    assert (lw.window, lw.kernel, lw.layer_wise) == (32, 5, True)
    with pytest.raises(ValueError, match="kernel"):
        DefensiveKV(kernel=4)
    with pytest.raises(TypeError, match="layer_wise"):
        DefensiveKV(layer_wise="yes")
    with pytest.raises(ValueError, match="window=32"):
        DefensiveKV().plan((40, 30), 2, HKV, compression_ratio=0.5)
    with pytest.raises(ValueError, match="protected"):
        DefensiveKV(window=4).plan((40, 30), 2, HKV, budget=4)
