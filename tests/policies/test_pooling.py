"""The positional smoothing of scores (kvjax.policies.scoring): pool1d's window offset, bridge1d and trail1d,
against loops written from their docstrings."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.policies.scoring import bridge1d, pool1d, trail1d


def _region(n: int, lo: int, hi: int) -> np.ndarray:
    return (np.arange(n) >= lo) & (np.arange(n) < hi)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_pool1d_offset_windows_match_a_loop(data):
    n = data.draw(st.integers(1, 24))
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    kernel = data.draw(st.sampled_from([1, 3, 5, 7, 15]))
    offset = data.draw(st.integers(0, kernel // 2))
    x = np.random.RandomState(n * 31 + kernel).rand(2, n).astype(np.float32)
    region = _region(n, lo, hi)
    got = np.asarray(pool1d(jnp.asarray(x), jnp.asarray(region), kernel, "max", offset))
    r = kernel // 2
    for j in range(lo, hi):
        a, b = max(lo, j - r - offset), min(hi, j + r - offset + 1)
        np.testing.assert_array_equal(got[:, j], x[:, a:b].max(-1))


def test_pool1d_offset_leans_forward_and_checks_its_range():
    x = np.zeros(12, np.float32)
    x[3] = 1.0
    region = np.ones(12, bool)
    centred = np.asarray(pool1d(jnp.asarray(x), jnp.asarray(region), 5, "max"))
    leaning = np.asarray(pool1d(jnp.asarray(x), jnp.asarray(region), 5, "max", 2))
    assert np.flatnonzero(centred).tolist() == [1, 2, 3, 4, 5]
    assert np.flatnonzero(leaning).tolist() == [3, 4, 5, 6, 7]  # the peak lends to the 4 slots after it
    with pytest.raises(ValueError, match=r"offset must be in \[0, kernel // 2 = 2\]"):
        pool1d(jnp.asarray(x), jnp.asarray(region), 5, "max", 3)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_bridge1d_matches_a_loop(data):
    n = data.draw(st.integers(1, 24))
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    reach = data.draw(st.integers(0, 8))
    x = np.random.RandomState(n * 7 + reach).rand(3, n).astype(np.float32)
    got = np.asarray(bridge1d(jnp.asarray(x), jnp.asarray(_region(n, lo, hi)), reach))
    want = x.copy()
    for j in range(lo, hi):
        left = x[:, max(lo, j - reach):j + 1].max(-1)
        right = x[:, j:min(hi, j + reach + 1)].max(-1)
        want[:, j] = np.maximum(x[:, j], np.minimum(left, right))
    np.testing.assert_array_equal(got, want)


def test_bridge1d_fills_a_valley_between_peaks_but_does_not_spread_a_lone_one():
    x = np.full(30, 0.1, np.float32)
    x[2], x[9] = 0.9, 0.6  # a key and the end of its value, 7 slots apart
    x[22] = 0.8  # a lone peak, 13 slots further
    y = np.asarray(bridge1d(jnp.asarray(x), jnp.ones(30, bool), 6))
    np.testing.assert_allclose(y[3:9], 0.6)  # every slot between sees both flanks within 6: risen to the lower
    assert y[2] == pytest.approx(0.9) and y[9] == pytest.approx(0.6) and y[22] == pytest.approx(0.8)
    np.testing.assert_allclose(np.delete(y, np.r_[2:10, 22]), 0.1)  # nothing else moves
    z = np.asarray(bridge1d(jnp.asarray(x), jnp.ones(30, bool), 4))
    np.testing.assert_allclose(z[[3, 4, 7, 8]], 0.1)  # within 4 of only one flank
    np.testing.assert_allclose(z[5:7], 0.6)  # within 4 of both
    assert (np.asarray(bridge1d(jnp.asarray(x), jnp.ones(30, bool), 3)) == x).all()  # 7 apart > 2 x 3
    np.testing.assert_array_equal(np.asarray(bridge1d(jnp.asarray(x), jnp.ones(30, bool), 0)), x)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_trail1d_is_the_max_of_the_slots_before(data):
    n = data.draw(st.integers(1, 24))
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    reach = data.draw(st.integers(1, 8))
    x = np.random.RandomState(n * 5 + reach).rand(2, n).astype(np.float32)
    got = np.asarray(trail1d(jnp.asarray(x), jnp.asarray(_region(n, lo, hi)), reach))
    for j in range(n):
        before = [i for i in range(max(0, j - reach), j) if lo <= i < hi]
        want = x[:, before].max(-1) if before else np.full(2, -np.inf, np.float32)
        np.testing.assert_array_equal(got[:, j], want)
    with pytest.raises(ValueError, match="reach must be >= 1"):
        trail1d(jnp.asarray(x), jnp.asarray(_region(n, lo, hi)), 0)
