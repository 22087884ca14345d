"""The shared selection primitive against a NumPy sort, with many ties (policies.md §1.5-1.6)."""

from __future__ import annotations

import jax
import pytest
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.policies.base import first_in_order, inverse_permutation, rank, recent_mask, select

_select = jax.jit(lambda s, v, c, p, pr, tb: select(s, v, c, pos=p, protected=pr, tiebreak=tb))


def reference_keep(scores, valid, count, pos, protected, tiebreak):
    """Protected first (most recent first), then score desc, tiebreak desc, position asc."""
    idx = [i for i in range(len(scores)) if valid[i]]
    prot = sorted((i for i in idx if protected[i]), key=lambda i: -pos[i])
    rest = sorted((i for i in idx if not protected[i]), key=lambda i: (-scores[i], -tiebreak[i], pos[i]))
    return set((prot + rest)[:count])


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 40))
def test_select_matches_numpy_sort(seed, count):
    rng = np.random.default_rng(seed)
    shape = (2, 3, 24)
    scores = rng.integers(0, 4, shape).astype(np.float32) * rng.choice([1.0, -1.0])  # heavy ties, +-0.0
    valid = rng.random(shape) < 0.8
    pos = np.stack([np.stack([rng.permutation(100)[:24] for _ in range(3)]) for _ in range(2)]).astype(np.int32)
    protected = rng.random(shape) < 0.2
    tiebreak = rng.integers(0, 3, shape).astype(np.int32)
    counts = np.full(shape[:2], count, np.int32)
    keep = np.asarray(_select(scores, valid, counts, pos, protected, tiebreak))
    for i in np.ndindex(shape[:2]):
        want = reference_keep(scores[i], valid[i], count, pos[i], protected[i], tiebreak[i])
        assert set(np.flatnonzero(keep[i])) == want
        assert keep[i].sum() == min(count, valid[i].sum())


def test_rank_is_a_permutation_and_ties_go_to_lower_positions():
    scores = np.zeros((1, 6), np.float32)
    valid = np.array([[True, True, False, True, True, True]])
    pos = np.array([[5, 3, -1, 9, 0, 7]], np.int32)
    r = np.asarray(rank(scores, valid, pos=pos))
    assert sorted(r[0]) == list(range(6))
    assert list(np.argsort(r[0])) == [4, 1, 0, 5, 3, 2]  # equal scores: by position; invalid last
    assert np.asarray(recent_mask(pos, valid, 2))[0].tolist() == [False, False, False, True, False, True]


def test_traced_per_row_counts():
    scores = np.arange(12, dtype=np.float32).reshape(3, 4)
    valid = np.ones((3, 4), bool)
    pos = np.tile(np.arange(4, dtype=np.int32), (3, 1))
    keep = np.asarray(jax.jit(lambda c: select(scores, valid, c, pos=pos))(np.array([0, 2, 9], np.int32)))
    assert keep.sum(-1).tolist() == [0, 2, 4]
    assert keep[1].tolist() == [False, False, True, True]


@pytest.mark.parametrize("positions", ["shuffled", "ascending", "ascending-past-4M"])
@pytest.mark.parametrize("invert_by", ["scatter", "sort"])
def test_rank_matches_a_python_sort_with_infinities_and_tiebreaks(invert_by, positions):
    """The whole rank (not only a kept set), with scores at +-inf and +-0.0, protected slots and a tiebreak;
    the permutation inverted by a scatter (the default but on TPUs) or by a second sort (TPUs); positions
    shuffled over the slots, ascending (a prefill's cache), or ascending past 4M."""
    rng = np.random.default_rng(3)
    shape = (2, 3, 29)
    scores = rng.choice(np.array([-np.inf, -1.5, -0.0, 0.0, 0.5, 2.0, np.inf], np.float32), shape)
    valid = rng.random(shape) < 0.85
    pos = np.stack([np.stack([rng.permutation(60)[:29] for _ in range(3)]) for _ in range(2)]).astype(np.int32)
    if positions != "shuffled":
        pos = np.sort(pos, axis=-1) + (0 if positions == "ascending" else (1 << 22) - 30)
        pos[~valid & (rng.random(shape) < 0.5)] = -1  # empty slots
    protected = rng.random(shape) < 0.15
    tiebreak = rng.integers(0, 3, shape).astype(np.float32)
    ranked = jax.jit(lambda pr, tb: rank(scores, valid, pos=pos, protected=pr, tiebreak=tb, invert_by=invert_by))
    for prot, tb in ((None, None), (protected, None), (protected, tiebreak)):
        r = np.asarray(ranked(prot, tb))
        for i in np.ndindex(shape[:2]):
            p = np.zeros(29, bool) if prot is None else prot[i] & valid[i]
            t = np.zeros(29) if tb is None else tb[i]
            group = np.where(valid[i], np.where(p, 0, 1), 2)

            def key(j):
                if group[j] == 0:
                    return (0, 0.0, 0.0, -pos[i][j], j)
                if group[j] == 2:
                    return (2, 0.0, 0.0, pos[i][j], j)
                return (1, -float(scores[i][j]), -float(t[j]), pos[i][j], j)

            assert list(np.argsort(r[i])) == sorted(range(29), key=key)


def test_inverse_permutation_and_select_reject_an_unknown_method():
    with pytest.raises(ValueError, match=r"by must be one of \('scatter', 'sort'\), got 'gather'"):
        inverse_permutation(np.arange(4, dtype=np.int32), "gather")
    with pytest.raises(ValueError, match=r"by must be one of \('bisection', 'sort'\), got 'radix'"):
        select(np.zeros((1, 4), np.float32), np.ones((1, 4), bool), 2, pos=np.arange(4)[None], by="radix")


@pytest.mark.parametrize("by", ["bisection", "sort"])
@pytest.mark.parametrize("positions", ["shuffled", "ascending"])
def test_select_is_rank_below_count_for_every_count(positions, by):
    """select (by bisection, no sort: the CPU default; or by rank's sort: accelerators) keeps exactly the slots
    with rank < count: per-row counts from 0 past the row length, scores with +-inf, +-0.0 and NaN, protected
    slots, and a float tiebreak with +-0.0 and NaN."""
    rng = np.random.default_rng(7)
    shape = (3, 4, 37)
    scores = rng.choice(np.array([-np.inf, -1.5, -0.0, 0.0, 0.5, 2.0, np.inf, np.nan, -np.nan], np.float32), shape)
    valid = rng.random(shape) < 0.8
    pos = np.stack([np.stack([rng.permutation(90)[:37] for _ in range(4)]) for _ in range(3)]).astype(np.int32)
    if positions == "ascending":
        pos = np.sort(pos, axis=-1)
    protected = rng.random(shape) < 0.15
    tiebreak = rng.choice(np.array([-0.0, 0.0, 1.0, np.nan], np.float32), shape)
    counts = rng.integers(0, 42, shape[:2]).astype(np.int32)
    counts[0, :2] = (0, 40)
    for prot, tb in ((None, None), (protected, None), (protected, tiebreak)):
        want = valid & (np.asarray(rank(scores, valid, pos=pos, protected=prot, tiebreak=tb)) < counts[..., None])
        got = np.asarray(jax.jit(lambda c: select(scores, valid, c, pos=pos, protected=prot, tiebreak=tb,
                                                  by=by))(counts))
        np.testing.assert_array_equal(got, want)


def test_first_in_order_at_the_int32_extremes():
    """Keys at int32 min and max, and counts of 0, 1, all and more than all (the bisection's edges)."""
    info = np.iinfo(np.int32)
    key = np.array([[info.max, info.min, 0, info.min, info.max, -1]] * 5, np.int32)
    counts = np.array([0, 1, 3, 6, 9], np.int32)
    got = np.asarray(first_in_order([jax.numpy.asarray(key)], jax.numpy.asarray(counts)))
    order = np.lexsort((np.arange(6), key[0]))  # by key, then slot
    for row, c in zip(got, counts):
        assert set(np.flatnonzero(row)) == set(order[:c].tolist())
