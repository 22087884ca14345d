"""KVCache: append into free slots, eviction, compaction, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache, gather_slots, kept_sources


def _filled(L=2, B=2, H=3, C=8, D=4, n=6):
    cache = KVCache.init(L, B, H, C, D, jnp.float32)
    k = jnp.arange(L * B * H * n * D, dtype=jnp.float32).reshape(L, B, H, n, D)
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
    return cache.append(k, -k, pos), k


def test_append_fills_first_free_slots_in_order():
    cache, k = _filled()
    np.testing.assert_array_equal(cache.k[..., :6, :], k)
    np.testing.assert_array_equal(cache.v[..., :6, :], -k)
    assert cache.valid[..., :6].all() and not cache.valid[..., 6:].any()
    np.testing.assert_array_equal(cache.pos[0, 0, 0], [0, 1, 2, 3, 4, 5, -1, -1])


def test_append_reuses_evicted_slots():
    cache, _ = _filled()
    keep = jnp.ones(cache.valid.shape, bool).at[..., 2].set(False)
    cache = cache.evict(keep)
    assert not cache.valid[..., 2].any() and (cache.pos[..., 2] == -1).all()
    new = jnp.full(cache.k.shape[:3] + (1, 4), 7.0)
    cache = cache.append(new, new, jnp.full((2, 1), 6, jnp.int32))
    assert (cache.pos[..., 2] == 6).all() and (cache.k[..., 2, :] == 7.0).all()


def test_append_padding_is_not_valid():
    cache = KVCache.init(1, 2, 1, 4, 2, jnp.float32)
    x = jnp.ones((1, 2, 1, 2, 2))
    cache = cache.append(x, x, jnp.array([[0, 1], [0, -1]], jnp.int32))
    np.testing.assert_array_equal(cache.valid[0, :, 0, :2], [[True, True], [True, False]])


def test_compact_gathers_kept_sorted_by_position_and_shrinks_bytes():
    cache, k = _filled(C=8)
    rng = np.random.RandomState(0)
    keep = jnp.asarray(rng.rand(*cache.valid.shape) < 0.5)
    small, src = cache.compact(keep, capacity=6)
    assert small.capacity == 6 and small.nbytes() < cache.nbytes()
    kept = np.asarray(keep & cache.valid)
    for idx in np.ndindex(kept.shape[:3]):
        slots = np.flatnonzero(kept[idx])
        n = len(slots)
        np.testing.assert_array_equal(np.asarray(small.pos[idx])[:n], np.asarray(cache.pos[idx])[slots])
        np.testing.assert_array_equal(np.asarray(small.k[idx])[:n], np.asarray(cache.k[idx])[slots])
        np.testing.assert_array_equal(np.asarray(src[idx])[:n], slots)
        assert not np.asarray(small.valid[idx])[n:].any() and (np.asarray(src[idx])[n:] == -1).all()
    np.testing.assert_array_equal(np.asarray(gather_slots(cache.pos, src))[np.asarray(small.valid)],
                                  np.asarray(small.pos)[np.asarray(small.valid)])
    assert small.nbytes_in_use() == int(kept.sum()) * 2 * 4 * 4


def test_compact_refuses_overflow():
    cache, _ = _filled()
    with pytest.raises(ValueError, match="capacity=3"):
        cache.compact(cache.valid, capacity=3)


def _kept_in_position_order(keep: np.ndarray, pos: np.ndarray, capacity: int) -> list[list[int]]:
    """Per (leading index) row: the kept slots sorted by position, at most `capacity` (the spec, in Python)."""
    out = []
    for idx in np.ndindex(keep.shape[:-1]):
        slots = [s for s in range(keep.shape[-1]) if keep[idx][s]]
        out.append(sorted(slots, key=lambda s: pos[idx][s])[:capacity])
    return out


@pytest.mark.parametrize("ascending", [True, False], ids=["slots-in-position-order", "shuffled-positions"])
@pytest.mark.parametrize("capacity", [5, 12])
@pytest.mark.parametrize("by", [None, "count", "sort"])
def test_kept_sources_lists_kept_slots_by_position(ascending, capacity, by):
    """Both orders, and the automatic choice (jitted, so the count path's fallback is a lax.cond), give the
    kept slots in position order, whether or not positions ascend along the slots (an evict-then-append
    cache reuses freed slots for later positions)."""
    rng = np.random.RandomState(capacity + ascending)
    shape = (2, 3, 4, 10)
    pos = np.broadcast_to(np.arange(10) * 3 + 1, shape).copy()
    if not ascending:
        for idx in np.ndindex(shape[:-1]):
            pos[idx] = rng.permutation(pos[idx])
    keep = rng.rand(*shape) < 0.45
    keep[0, 0, 0] = False  # a head that keeps nothing
    got = np.asarray(jax.jit(lambda k, p: kept_sources(k, p, capacity, by=by))(jnp.asarray(keep), jnp.asarray(pos)))
    assert got.shape == shape[:-1] + (capacity,) and got.dtype == np.int32
    for row, want in zip(got.reshape(-1, capacity), _kept_in_position_order(keep, pos, capacity)):
        np.testing.assert_array_equal(row[:len(want)], want)


def test_compact_after_evict_and_append_orders_by_position():
    """Freed slot 2 takes position 6: the compacted cache still lists positions in order (the sort path)."""
    cache, _ = _filled()
    cache = cache.evict(jnp.ones(cache.valid.shape, bool).at[..., 2].set(False))
    new = jnp.full(cache.k.shape[:3] + (1, 4), 7.0)
    cache = cache.append(new, new, jnp.full((2, 1), 6, jnp.int32))
    small, src = jax.jit(lambda c: c.compact(c.valid & (c.pos != 4), 6))(cache)
    np.testing.assert_array_equal(np.asarray(small.pos[0, 0, 0]), [0, 1, 3, 5, 6, -1])
    np.testing.assert_array_equal(np.asarray(src[0, 0, 0]), [0, 1, 3, 5, 2, -1])


def test_kept_sources_rejects_unknown_order():
    with pytest.raises(ValueError, match="by='scatter'.*'count', 'sort'"):
        kept_sources(jnp.ones((1, 4), bool), jnp.arange(4)[None], 4, by="scatter")
