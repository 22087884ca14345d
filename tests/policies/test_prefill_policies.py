"""Each prefill-time policy's scores and kept sets against the NumPy reference (GQA 8/2, padded batch of 3)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import pol_reference as R
from kvjax.policies import (
    CAKE,
    H2O,
    TOVA,
    Ada,
    Cake,
    AdaPyramidKV,
    AdaSnapKV,
    H2OPrefill,
    KNorm,
    Pyramid,
    PyramidKV,
    Random,
    SnapKV,
    StreamingLLM,
    get,
)
from pol_helpers import HKV, assert_same_kept, kept_positions, make_inputs
from pol_prefill_ref import cake_raw_budgets, reference_prefill

WINDOW = 8  # observation window the test prefill records (policies slice their own w <= 8)


@functools.lru_cache(maxsize=None)
def inputs(seed=0, lengths=(29, 17, 23), layers=3):
    return make_inputs(seed, lengths=lengths, window=WINDOW, num_layers=layers)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prefill(policy, plan, cache, obs):
    return policy.prefill_keep(plan, cache, obs)[0]


def run(policy, inp, budget=None, ratio=None):
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=budget, compression_ratio=ratio, max_new_tokens=4)
    keep = np.asarray(_prefill(policy, plan, inp.cache, inp.obs))
    return plan, keep


def check_against_reference(policy, inp, budget=None, ratio=None, tol=1e-5):
    plan, keep = run(policy, inp, budget, ratio)
    got = kept_positions(keep, inp.cache.pos)
    want = reference_prefill(policy, inp, budget, ratio)
    assert set(got) == set(want)
    for idx, (ref_kept, scores, prot) in want.items():
        assert_same_kept(got[idx], ref_kept, scores, prot, tol=tol, where=f"{type(policy).__name__} (l,b,h)={idx}")
    room = 1 if policy.decode_time else plan.max_new_tokens  # a free slot for the next write
    assert keep.sum(-1).max() <= plan.capacity - room
    return plan, keep, want


def check_scores(policy, inp, budget=None, ratio=None, rtol=2e-4):
    """The scorer's float32 scores equal the reference on every candidate slot."""
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=budget, compression_ratio=ratio)
    scored = jax.jit(policy.score, static_argnums=0)(plan, inp.cache, inp.obs)
    s = np.asarray(scored.scores)
    want = reference_prefill(policy, inp, budget, ratio)
    for (l, b, h), (_, ref_scores, _) in want.items():
        pos = sorted(ref_scores)
        np.testing.assert_allclose(s[l, b, h, pos], [ref_scores[p] for p in pos], rtol=rtol, atol=1e-6,
                                   err_msg=f"{type(policy).__name__} scores at (l,b,h)=({l},{b},{h})")


SNAP_VARIANTS = [
    SnapKV(window=6),  # paper: max-pool 7, sum over window, group mean before pooling
    get("snapkv_kvpress", window=6),  # avg-pool 5 (count_include_pad), mean, group mean after pooling
    SnapKV(window=5, kernel=3, pooling="avg", gqa_reduce="max", gqa_order="after"),
    SnapKV(window=4, kernel=5, pooling="max", gqa_reduce="max", gqa_order="before"),
    SnapKV(window=3, pooling="none", kernel=1, gqa_reduce="sum"),
]


@pytest.mark.parametrize("policy", SNAP_VARIANTS, ids=lambda p: f"w{p.window}-{p.pooling}{p.kernel}-{p.gqa_order}")
def test_snapkv_scores_and_kept_sets(policy):
    inp = inputs()
    check_scores(policy, inp, budget=14)
    check_against_reference(policy, inp, budget=14)


def test_snapkv_short_row_is_left_whole_and_kvpress_ratio():
    inp = inputs(lengths=(29, 11, 23))
    _, keep, _ = check_against_reference(SnapKV(window=6), inp, budget=12)  # row 1: T=11 < C=12
    assert keep[:, 1].sum(-1).min() == 11
    check_against_reference(get("snapkv_kvpress", window=6), inp, ratio=0.5)
    check_against_reference(get("snapkv_kvpress", window=6), inp, ratio=0.8)  # n_kept < w in row 1


@pytest.mark.parametrize(
    "policy,budget,ratio",
    [
        (PyramidKV(window=4), 11, None),  # T >= 2*B0 for rows 0 and 2: the linear schedule
        (PyramidKV(window=4, allocator=Pyramid(beta=2)), 8, None),
        (get("pyramidkv_kvpress", window=4), None, 0.5),
        (get("pyramidkv_kvpress", window=4, allocator=Pyramid(beta=3, rule="kvpress")), None, 0.3),
    ],
    ids=["paper-b20", "paper-b2", "kvpress-r0.5", "kvpress-b3-r0.3"],
)
def test_pyramidkv_matches_reference(policy, budget, ratio):
    inp = inputs()
    plan, keep, _ = check_against_reference(policy, inp, budget, ratio)
    for l in range(inp.num_layers):  # uniform across heads, exactly the planned count per layer
        np.testing.assert_array_equal(keep[l].sum(-1), np.broadcast_to(np.asarray(plan.counts[l])[:, None], (3, HKV)))


@pytest.mark.parametrize(
    "policy,budget,ratio",
    [
        (AdaSnapKV(window=6), 12, None),
        (AdaSnapKV(window=6, allocator=Ada(alpha=0.5)), 10, None),
        (AdaSnapKV(window=4, allocator=Ada(alpha=0.2, normalize=True, skip=1)), 10, None),
        (AdaPyramidKV(window=4, allocator=Ada(alpha=0.2, pyramid_beta=3)), 9, None),
        (get("adakv_snapkv_kvpress", window=6), None, 0.5),
        (get("adakv_snapkv_kvpress", window=6), None, 0.75),
    ],
    ids=["ada-a0.2", "ada-a0.5", "ada-normalize-skip", "ada-pyramid", "kvpress-0.5", "kvpress-0.75"],
)
def test_ada_kv_matches_reference(policy, budget, ratio):
    inp = inputs()
    plan, keep, want = check_against_reference(policy, inp, budget, ratio)
    counts = keep.sum(-1)
    for (l, b, h), (ref_kept, _, _) in want.items():
        assert counts[l, b, h] == len(ref_kept)
    assert counts.max() <= plan.capacity - plan.max_new_tokens


@pytest.mark.parametrize(
    "policy,budget",
    [
        (SnapKV(window=4, allocator=Cake(window=6, tau1=0.7, tau2=2.0)), 9),
        (KNorm(skip_layers=(), allocator=Ada(alpha=0.3)), 12),
        (KNorm(skip_layers=(1,), allocator=Pyramid(beta=4)), 11),
        (Random(seed=2, allocator=Ada(alpha=0.2, pyramid_beta=3)), 10),
    ],
    ids=["snapkv+cake", "knorm+ada", "knorm+pyramid", "random+ada-pyramid"],
)
def test_allocators_compose_with_any_scorer(policy, budget):
    check_against_reference(policy, inputs(seed=2), budget)


def test_ada_heads_really_differ():
    inp = inputs(seed=3)
    _, keep = run(AdaSnapKV(window=6), inp, budget=12)
    assert (keep.sum(-1)[:, 0, 0] != keep.sum(-1)[:, 0, 1]).any()


@pytest.mark.parametrize(
    "policy,budget",
    [
        (CAKE(window=6, gamma=200.0, decode=False), 10),
        (CAKE(window=4, gamma=5.0, tau1=1.6, tau2=0.4, decode=False), 8),
        (CAKE(window=4, parity=True, decode=False), 7),
    ],
    ids=["default", "taus", "parity"],
)
def test_cake_matches_reference(policy, budget):
    inp = inputs(seed=1)
    for b, T in enumerate(inp.lengths):  # skip the measure-zero case of a raw budget at an integer
        raw = cake_raw_budgets(policy, inp, b, T, budget, None)
        if raw is not None:
            frac = np.abs(raw[0] - np.round(raw[0]))
            assert frac.min() > 1e-4, "raw budget too close to an integer for a float32 comparison"
    check_scores(policy, inp, budget=budget, rtol=5e-4)
    plan, keep, _ = check_against_reference(policy, inp, budget)
    # layer budgets vary, heads within a layer agree; the total over layers is (C - w) * L per row
    for b, T in enumerate(inp.lengths):
        if T > budget + policy.window:
            per_layer = keep[:, b, 0].sum(-1) - policy.window
            assert (keep[:, b].sum(-1) == keep[:, b, :1].sum(-1)).all()
            clip = T - policy.window if policy.parity else min(T - policy.window, 2 * (budget - policy.window))
            if per_layer.max() < clip:
                assert per_layer.sum() == (budget - policy.window) * inp.num_layers


def test_knorm_random_h2o_prefill_tova_streaming():
    inp = inputs()
    for policy, budget, ratio in [
        (KNorm(), 9, None),
        (get("knorm_kvpress"), None, 0.6),
        (Random(seed=3), 10, None),
        (get("random", seed=11), None, 0.5),
        (H2OPrefill(window=4), 12, None),
        (get("observed_attention_kvpress"), None, 0.5),
        (H2O(), 12, None),
        (H2O(recent=3), 10, None),
        (TOVA(), 10, None),
        (get("tova_kvpress"), None, 0.5),
        (StreamingLLM(), 10, None),
        (get("streaming_llm_kvpress"), None, 0.7),
        (get("streaming_llm_kvpress"), None, 0.9),  # n_kept < n_sink for short rows
    ]:
        check_against_reference(policy, inp, budget, ratio, tol=2e-5)
        if hasattr(policy, "score"):
            check_scores(policy, inp, budget, ratio)


def test_tova_scores_match_reference():
    inp = inputs()
    policy = TOVA()
    plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=8)
    s = np.asarray(jax.jit(policy.prefill_scores, static_argnums=0)(plan, inp.cache, inp.obs))
    for l in range(inp.num_layers):
        for b, T in enumerate(inp.lengths):
            ref = R.window_attention(inp.q[l, b].astype(float), inp.k[l, b].astype(float), T, 1)[:, 0, :T].mean(0)
            for h in range(HKV):
                np.testing.assert_allclose(s[l, b, h, :T], ref, rtol=2e-4, atol=1e-7)


def test_plan_may_be_traced():
    """The plan is a pytree: passed as a traced argument it gives the same kept sets as static."""
    inp = inputs()
    for policy, budget in [(SnapKV(window=6), 12), (AdaSnapKV(window=6), 12), (CAKE(window=6, decode=False), 10)]:
        plan = policy.plan(inp.lengths, inp.num_layers, HKV, budget=budget)
        static = np.asarray(_prefill(policy, plan, inp.cache, inp.obs))
        traced = np.asarray(jax.jit(lambda p, c, o, pol=policy: pol.prefill_keep(p, c, o)[0])(plan, inp.cache, inp.obs))
        np.testing.assert_array_equal(static, traced)
