"""CAKE's cascading prefill (cakekv --cascading) against the NumPy replay of the per-layer re-evictions."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from pol_helpers import make_inputs
from pol_prefill_ref import cake_raw_budgets, reference_prefill
from pol_scorers_ref import cake_cascade_reference, check_kept

from kvjax.policies import CAKE, get


@functools.cache
def inputs(seed=1, lengths=(29, 17, 23), layers=4):
    return make_inputs(seed, lengths=lengths, window=8, num_layers=layers)


@pytest.mark.parametrize(
    "kw,budget,seed,layers,differs",
    [
        (dict(window=6), 10, 1, 4, False),
        (dict(window=4, gamma=5.0, tau1=1.6, tau2=0.4), 8, 1, 4, False),
        (dict(window=4, parity=True), 7, 2, 4, False),
        # sharp preferences (small tau): the fix-up's redistribution makes budgets non-monotone
        (dict(window=4, gamma=5.0, tau1=0.2, tau2=2.0), 7, 1, 4, True),
        (dict(window=4, tau1=0.3, tau2=0.3), 7, 1, 6, True),
    ],
    ids=["default", "taus", "parity", "sharp-L4", "sharp-L6"],
)
def test_cascade_matches_reference(kw, budget, seed, layers, differs):
    inp = inputs(seed, layers=layers)
    for b, T in enumerate(inp.lengths):  # skip the measure-zero case of a raw budget at an integer
        raw = cake_raw_budgets(CAKE(**kw), inp, b, T, budget, None)
        for step in range(1, layers if raw is not None else 0):  # each step's raw budgets (step 0: exact)
            share = raw[0][: step + 1] / raw[0][: step + 1].sum() * raw[1]
            assert np.abs(share - np.round(share)).min() > 1e-4
    policy = CAKE(cascade=True, decode=False, **kw)
    want = cake_cascade_reference(policy, inp, budget)
    check_kept(policy, inp, want, budget)
    # the cascade never keeps more than one-shot CAKE in a layer; where budgets are non-monotone
    # across the steps, it keeps less
    one_shot = reference_prefill(CAKE(decode=False, **kw), inp, budget)
    assert all(len(want[i][0]) <= len(one_shot[i][0]) for i in want)
    assert any(want[i][0] != one_shot[i][0] for i in want) == differs


def test_preset_and_errors():
    p = get("cake_cascade")
    assert p.cascade and p.budget_allocator().cascade and (p.window, p.gamma) == (32, 200.0)
    assert not get("cake").cascade
    with pytest.raises(TypeError, match="cascade"):
        CAKE(cascade=1)
