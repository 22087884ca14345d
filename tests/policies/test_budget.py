"""Host budget arithmetic and the allocators (policies.md §1.1, §6, §7, §8)."""

from __future__ import annotations

from fractions import Fraction

import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pol_reference as R
from kvjax.policies import Ada, Cake, Pyramid, Uniform
from kvjax.policies.allocators import cake_adjust_budgets, pyramid_kvpress, pyramid_paper
from kvjax.policies.base import PlanRequest, kvpress_n_kept


def allocate(allocator, lengths, num_layers, num_kv_heads, *, budget, ratio, protect, compat):
    req = PlanRequest.checked(lengths, num_layers, num_kv_heads, budget, ratio, 0, None)
    return allocator.allocate(req, protect=protect, compat=compat)


def test_kvpress_n_kept_float64_table():
    """int(T*(1-r)) in float64 is one below the exact value for exactly the documented T."""
    table = {0.3: (289, [90, 170, 180, 330, 340]), 0.8: (3999, [5, 10, 15]), 0.9: (1999, [10, 20, 30])}
    for r in (0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.875, 0.9):
        exact = 1 - Fraction(str(r))
        low = [T for T in range(1, 20000) if kvpress_n_kept(T, r) == int(T * exact) - 1]
        assert all(kvpress_n_kept(T, r) in (int(T * exact), int(T * exact) - 1) for T in range(1, 2000))
        n, first = table.get(r, (0, []))
        assert len(low) == n, r
        assert low[: len(first)] == first, r


def test_kvpress_compat_main_keeps_at_least_one():
    assert kvpress_n_kept(3, 0.9) == 0
    assert kvpress_n_kept(3, 0.9, "main") == 1
    assert kvpress_n_kept(30, 0.9, "main") == kvpress_n_kept(30, 0.9) == 2


def test_pyramid_paper_worked_example():
    caps = pyramid_paper(8000, 2048, 32, 32, 20)
    nonwin = [c - 32 for c in caps]
    assert nonwin[0] == 3932 and nonwin[-1] == 119
    assert sum(nonwin) == 64816 > 32 * 2016  # the floored step leaves the total slightly above L*B0
    assert pyramid_paper(2000, 2048, 32, 32, 20) == [2000] * 32  # T < C: untouched
    assert pyramid_paper(3000, 2048, 32, 32, 20) == [2048] * 32  # T < 2*B0: uniform


def test_pyramid_kvpress_worked_example_and_fallback():
    n = pyramid_kvpress(4096, 4096 * (1 - 0.5), 64, 32, 20)
    assert n[:2] == [3994, 3868] and n[-1] == 102
    assert abs(np.mean(n) - 2048) / 2048 < 1e-3
    # T(1-r) < 1280 with w=64, beta=20: the uniform fallback (kvpress PyramidKV == SnapKV)
    assert pyramid_kvpress(4096, 4096 * (1 - 0.7), 64, 32, 20) == [round(4096 * (1 - 0.7))] * 32


@settings(max_examples=20, deadline=None)
@given(
    T=st.integers(10, 5000), C=st.integers(2, 4000), w=st.integers(1, 64), L=st.integers(2, 40), beta=st.integers(1, 30)
)
def test_pyramid_rules_match_reference_and_totals(T, C, w, L, beta):
    assume(C > w)
    got = pyramid_paper(T, C, w, L, beta)
    want = R.pyramid_paper(T, C, w, L, beta)
    assert got == [min(T, max(x, w)) for x in want]
    if T >= 2 * (C - w) and T >= C:  # the linear schedule: total >= L*B0, by less than L(L-1)/2
        b0 = C - w
        extra = sum(x - w for x in want) - L * b0
        assert 0 <= extra < L * (L - 1) / 2 + 1
    r = 1 - C / T if C < T else 0.5
    got = pyramid_kvpress(T, T * (1 - r), w, L, beta)
    assert got == [min(T, x) for x in R.pyramid_kvpress(T, r, w, L, beta)]
    assert abs(sum(got) - L * T * (1 - r)) <= L / 2 + 1e-9  # layer mean is T(1-r) up to rounding


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=4), budget=st.integers(1, 400), L=st.integers(1, 6))
def test_uniform_total_is_the_budget(lengths, budget, L):
    alloc = allocate(Uniform(), lengths, L, 2, budget=budget, ratio=None, protect=0, compat="0.5.4")
    for b, t in enumerate(lengths):
        assert sum(alloc.counts[l][b] for l in range(L)) == L * min(budget, t)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), L=st.sampled_from([2, 5, 12]), total=st.integers(1, 3000), seq=st.integers(1, 800)
)
def test_cake_adjust_budgets_matches_reference(seed, L, total, seq):
    rng = np.random.default_rng(seed)
    share = rng.dirichlet(np.full(L, 0.3))
    raw = (share * total).astype(np.float32)
    assume(np.all(np.abs(raw - np.round(raw)) > 1e-3) or np.all(raw == np.floor(raw)))
    got = np.asarray(cake_adjust_budgets(jnp.asarray(raw)[:, None], jnp.array([total]), jnp.array([seq])))[:, 0]
    want = R.cake_adjust(raw.astype(np.float64), total, seq)
    assert got.tolist() == want
    if seq * L >= total:  # room for the whole budget: the fix-up makes the total exact
        assert got.sum() == total


def test_ada_host_plan_bounds():
    a = Ada(alpha=0.2)
    alloc = allocate(a, (100, 30), 2, 4, budget=20, ratio=None, protect=8, compat="0.5.4")
    assert alloc.counts == ((20, 20), (20, 20)) and alloc.data.floor == ((2, 2), (2, 2))  # F = int(12 * 0.2)
    # worst case, one head takes all min(T - w, 4*12) global picks: 8 + ceil(48*0.8 + 2) = 49; 8 + ceil(22*0.8 + 2) = 28
    assert alloc.bound == ((49, 28), (49, 28))
    none = allocate(a, (20,), 1, 4, budget=21, ratio=None, protect=8, compat="0.5.4")
    assert none.data.compressed == ((False,),) and not none.evicts  # B' = 13 > T - w = 12: no compression
    kv = allocate(Ada(alpha=0.2, rule="kvpress"), (100,), 1, 4, budget=None, ratio=0.5, protect=8, compat="0.5.4")
    assert kv.counts == ((50,),) and kv.data.floor == ((10,),) and kv.bound == ((100,),)
    # n_safe = int(n_kept * alpha): 0 in 0.5.4, clamped to 1 on kvpress main (PRs #264/#277)
    for compat, n_safe in (("0.5.4", 0), ("main", 1)):
        a = allocate(Ada(alpha=0.2, rule="kvpress"), (10,), 1, 4, budget=None, ratio=0.7, protect=0, compat=compat)
        assert a.counts == ((3,),) and a.data.floor == ((n_safe,),)


def test_cake_host_plan():
    c = Cake(window=4)
    alloc = allocate(c, (30, 12), 3, 2, budget=8, ratio=None, protect=4, compat="0.5.4")
    assert alloc.data.clip == ((8, 0), (8, 0), (8, 0))  # clip min(T - w, 2(C - w)); row 1: T <= C + w
    assert alloc.data.compressed == ((True, False),) * 3
    assert alloc.bound == ((12, 12), (12, 12), (12, 12))
    par = allocate(Cake(window=4, parity=True), (30,), 3, 2, budget=8, ratio=None, protect=4, compat="0.5.4")
    assert par.data.clip == ((26,), (26,), (26,))


def test_pyramid_allocator_rules():
    p = allocate(Pyramid(beta=20), (8000,), 32, 8, budget=2048, ratio=None, protect=32, compat="0.5.4")
    assert p.counts[0] == (3932 + 32,) and p.counts[-1] == (119 + 32,)
    k = allocate(Pyramid(rule="kvpress"), (4096,), 32, 8, budget=None, ratio=0.5, protect=64, compat="0.5.4")
    assert k.counts[0] == (3994,) and k.counts[-1] == (102,)
