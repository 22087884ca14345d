"""KVCache: append into free slots, eviction, compaction, bytes."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache, gather_slots


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
