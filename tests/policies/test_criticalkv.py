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
    for bad in (0, 3, True, "l2"):
        with pytest.raises(ValueError, match=r"value_norm must be 1 .* or 2"):
            CriticalKV(value_norm=bad)
    inp = inputs()
    pol = CriticalKV(scorer=SnapKV(window=6))
    plan = pol.plan(inp.lengths, 2, HKV, budget=12)
    with pytest.raises(ValueError, match="output_norms"):
        pol.prefill_keep(plan, inp.cache, inp.obs.replace(output_norms=None))


@pytest.mark.parametrize("kwargs,field", [({"value_norm": 2}, "output_norms_l2"),
                                          ({"value_norm": 2, "group_norm": "rms"}, "output_norms_rms")])
def test_other_norms_read_their_own_observation(kwargs, field):
    """value_norm=2 asks the prefill for `output_norms_l2`, with group_norm="rms" for `output_norms_rms`, and
    nothing else; stage 2 is weighted by what that field holds."""
    pol = CriticalKV(scorer=SnapKV(window=6), **kwargs)
    spec = pol.requirements().observe
    fields = ("output_norms", "output_norms_l2", "output_norms_rms")
    assert [bool(getattr(spec, f)) for f in fields] == [f == field for f in fields]
    inp = inputs()
    plan = pol.plan(inp.lengths, 2, HKV, budget=12)
    with pytest.raises(ValueError, match=field):
        pol.prefill_keep(plan, inp.cache, inp.obs)
    obs = inp.obs.replace(output_norms=None, **{field: inp.obs.output_norms})
    np.testing.assert_array_equal(np.asarray(pol.prefill_keep(plan, inp.cache, obs)[0]),
                                  np.asarray(CriticalKV(scorer=SnapKV(window=6)).prefill_keep(plan, inp.cache,
                                                                                               inp.obs)[0]))


def test_group_norm_errors():
    with pytest.raises(ValueError, match="group_norm='rms' needs value_norm=2"):
        CriticalKV(group_norm="rms")
    with pytest.raises(ValueError, match=r"group_norm must be one of \('mean', 'rms'\)"):
        CriticalKV(value_norm=2, group_norm="max")


@pytest.mark.parametrize("ord_", [1, 2, "rms"])
def test_output_norms_equal_numpy(ord_):
    """||v_j W_o^h||_ord, group mean (ord "rms": the group's root mean square of the L2 norms), 0 on padding
    keys: the blocked L1 product, the L2 Gram form and the summed Gram form against the product written out
    in NumPy."""
    import jax.numpy as jnp

    from kvjax.observations.output_norms import output_norms

    rng = np.random.default_rng({1: 1, 2: 2, "rms": 3}[ord_])
    B, Hkv, G, n, D, E = 2, 3, 2, 150, 8, 20  # n over one block of 128 keys
    v = rng.normal(size=(B, Hkv, n, D)).astype(np.float32)
    wo = rng.normal(size=(Hkv * G * D, E)).astype(np.float32)
    real = np.ones((B, n), bool)
    real[1, 140:] = False
    got = np.asarray(output_norms(jnp.asarray(v), jnp.asarray(wo), jnp.asarray(real), ord_))
    w = wo.reshape(Hkv, G, D, E).astype(np.float64)
    proj = np.einsum("bhnd,hgde->bhgne", v.astype(np.float64), w)
    if ord_ == "rms":
        want = np.sqrt((np.linalg.norm(proj, axis=-1) ** 2).mean(2)) * real[:, None, :]
        assert not np.allclose(want, np.linalg.norm(proj, axis=-1).mean(2) * real[:, None, :], rtol=1e-3)
    else:
        want = np.linalg.norm(proj, ord=ord_, axis=-1).mean(2) * real[:, None, :]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
    with pytest.raises(ValueError, match="ord must be one of"):
        output_norms(jnp.asarray(v), jnp.asarray(wo), jnp.asarray(real), 3)
