"""CriticalKV / CriticalAdaKV over several scorers against the NumPy reference (GQA 8/2, padded batch)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from pol_helpers import HKV, make_inputs
from pol_scorers_ref import check_kept, critical_reference

from kvjax.policies import AdaSnapKV, CriticalKV, KNorm, SnapKV, get


@functools.cache
def inputs(seed=0, lengths=(29, 17, 23)):
    return make_inputs(seed, lengths=lengths, window=8, num_layers=2)


@pytest.mark.parametrize(
    "policy,budget,ratio",
    [
        (CriticalKV(scorer=SnapKV(window=6)), 14, None),
        (CriticalKV(scorer=SnapKV(window=4), first_stage_ratio=0.3, epsilon=1e-2), 12, None),
        (get("critical_snapkv_kvpress", scorer=get("snapkv_kvpress", window=6)), None, 0.5),
        (get("critical_adakv_snapkv_kvpress", scorer=get("adakv_snapkv_kvpress", window=6)), None, 0.6),
        (CriticalKV(scorer=AdaSnapKV(window=6)), 12, None),
        (CriticalKV(scorer=KNorm(skip_layers=())), 9, None),
    ],
    ids=["snapkv", "snapkv-fsr0.3", "snapkv-kvpress", "adakv-kvpress", "ada-paper", "knorm"],
)
def test_kept_sets_equal_reference(policy, budget, ratio):
    inp = inputs()
    check_kept(policy, inp, critical_reference(policy, inp, budget, ratio), budget, ratio)


def test_output_norms_change_the_choice():
    """The second stage really reads the projected value norms: scaling one slot's norm up makes
    it kept, where the base scorer alone drops it."""
    inp = inputs()
    base = SnapKV(window=6)
    pol = CriticalKV(scorer=base)
    plan = pol.plan(inp.lengths, 2, HKV, budget=12)
    keep0 = np.asarray(base.prefill_keep(plan, inp.cache, inp.obs)[0])
    dropped = int(np.nonzero(~keep0[0, 0, 0, :20])[0][0])
    boosted = np.asarray(inp.obs.output_norms).copy()
    boosted[0, 0, 0, dropped] *= 1e6
    obs = inp.obs.replace(output_norms=boosted)
    keep = np.asarray(pol.prefill_keep(plan, inp.cache, obs)[0])
    assert keep[0, 0, 0, dropped]
    np.testing.assert_array_equal(keep.sum(-1), keep0.sum(-1))


def test_errors():
    with pytest.raises(TypeError, match="scorer must be a prefill policy"):
        CriticalKV(scorer="snapkv")
    with pytest.raises(ValueError, match="prefill-only"):
        CriticalKV(scorer=get("cake"))
    with pytest.raises(ValueError, match="first_stage_ratio"):
        CriticalKV(first_stage_ratio=1.5)
    with pytest.raises(ValueError, match="epsilon"):
        CriticalKV(epsilon=-1e-3)
    inp = inputs()
    pol = CriticalKV(scorer=SnapKV(window=6))
    plan = pol.plan(inp.lengths, 2, HKV, budget=12)
    with pytest.raises(ValueError, match="output_norms"):
        pol.prefill_keep(plan, inp.cache, inp.obs.replace(output_norms=None))
