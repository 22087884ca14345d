"""The ragged decode layout (kvjax.cache_ragged): per-layer capacities for layer-wise budgets and
per-head segments for head-wise ones store only the kept entries plus the decode room, keep the
same entries as the dense masked layout, attend as it does and give the same greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax.cache import KVCache
from kvjax.cache_ragged import choose_layout, from_cache
from kvjax.engine import api, steps
from kvjax.engine.inputs import STEP_BUCKETS, bucket_length
from kvjax.kernels.decode_attention.reference import decode_attention
from kvjax.kernels.segment_attention import segment_decode_attention
from kvjax.policies.cake import CAKE

N = 6  # generated tokens
RNG = np.random.RandomState(5)


def random_cache(key, L, B, H, C, D, valid):
    k1, k2 = jax.random.split(key)
    pos = jnp.where(valid, jnp.arange(C), -1).astype(jnp.int32)
    k = jax.random.normal(k1, (L, B, H, C, D))
    v = jax.random.normal(k2, (L, B, H, C, D))
    return KVCache(k=k, v=v, pos=jnp.broadcast_to(pos, valid.shape), valid=valid)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4), (6, 3)])
def test_segment_attention_equals_dense_masked_attention(hq, hkv):
    B, C, D = 3, 12, 16
    key = jax.random.PRNGKey(hkv)
    valid = jax.random.bernoulli(key, 0.5, (1, B, hkv, C))
    valid = valid.at[0, 0, 0].set(False)  # an empty head
    valid = valid.at[0, 2].set(False)  # a fully masked row
    cache = random_cache(jax.random.fold_in(key, 1), 1, B, hkv, C, D, valid)
    q = jax.random.normal(jax.random.fold_in(key, 2), (B, hq, D))
    counts = np.asarray(cache.num_valid())
    (kind, S), = choose_layout(counts, room=2)
    assert kind == "segmented"
    layer = from_cache(cache, (("segmented", S),), room=2).layers[0]
    seg = jnp.where(layer.pos >= 0, layer.seg, -1)
    # unattended slots may hold anything: their contents never reach the result
    k = jnp.where((seg >= 0)[..., None], layer.k, jnp.nan)
    v = jnp.where((seg >= 0)[..., None], layer.v, jnp.nan)
    out = segment_decode_attention(q, k, v, seg, num_kv_heads=hkv, scale=0.3)
    ref, _ = decode_attention(q, cache.k[0], cache.v[0], cache.valid[0], scale=0.3)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)
    np.testing.assert_array_equal(out[0, : hq // hkv], 0.0)


def test_layout_bytes_are_the_kept_entries_plus_room():
    L, B, H, C, D, room = 3, 2, 4, 10, 8, 3
    counts = np.array([[[4, 4, 4, 4], [4, 4, 4, 4]],  # layer-wise: a dense layer of capacity 4 + room
                       [[1, 6, 2, 3], [3, 3, 2, 4]],  # head-wise: segments, 12 entries per row
                       [[0, 0, 0, 0], [0, 0, 0, 0]]])
    valid = jnp.arange(C) < jnp.asarray(counts)[..., None]
    cache = random_cache(jax.random.PRNGKey(0), L, B, H, C, D, valid)
    layout = choose_layout(counts, room)
    assert layout == (("dense", 4 + room), ("segmented", 12 + H * room), ("dense", room))
    ragged = from_cache(cache, layout, room)
    entry = 2 * D * 4  # key + value, float32
    assert ragged.kv_nbytes() == entry * B * (H * (4 + room) + (12 + H * room) + H * room)
    assert ragged.kv_nbytes() == entry * (counts.sum() + L * B * H * room)
    np.testing.assert_array_equal(ragged.num_valid(), counts)
    got = ragged.kept_positions()
    want = [[[list(range(c)) for c in row] for row in layer] for layer in counts]
    assert got == want
    # rounding to a granule: the largest head count (layer-wise) or row total (head-wise) rounds up
    assert choose_layout(counts, room, granule=8) == (("dense", 8 + room), ("segmented", 16 + H * room),
                                                      ("dense", 8 + room))


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


POLICIES = {
    "pyramidkv": (policies.get("pyramidkv"), "dense"),
    "ada_snapkv": (policies.get("ada_snapkv"), "segmented"),
    "cake": (CAKE(window=8, decode=False), "dense"),
}


def _expected_nbytes(layout, B, H, D, itemsize):
    total = 0
    for kind, size in layout:
        slots = B * H * size if kind == "dense" else B * size
        meta = 4 if kind == "dense" else 8  # pos (+ segment id) per slot, int32
        total += slots * (2 * D * itemsize + meta) + B * H * 4 * (1 if kind == "dense" else 3)
    return total


@pytest.mark.parametrize("name", list(POLICIES))
def test_ragged_keeps_the_same_entries_in_fewer_bytes(stories, name, monkeypatch):
    monkeypatch.setattr(api, "RAGGED_GRANULE", 1)
    policy, kind = POLICIES[name]
    cfg = stories.config
    prompt = [[1] + RNG.randint(3, 512, 199).tolist()]
    dense = kvjax.engine.compress(stories, prompt, policy=policy, budget=48)
    counts = np.asarray(dense.num_valid())
    room = bucket_length(N, STEP_BUCKETS)
    layout = choose_layout(counts, room)
    assert kind in {k for k, _ in layout}
    ragged = steps.to_ragged(dense, layout=layout, room=room)
    np.testing.assert_array_equal(ragged.num_valid(), counts)
    pos, valid = np.asarray(dense.pos), np.asarray(dense.valid)
    want = [[[sorted(int(p) for p in pos[l, b, h][valid[l, b, h]]) for h in range(cfg.num_kv_heads)]
             for b in range(1)] for l in range(cfg.num_layers)]
    assert ragged.kept_positions() == want
    itemsize = np.dtype(cfg.jnp_dtype).itemsize
    entry = 2 * cfg.head_dim * itemsize
    # one row: every layer stores exactly its kept entries plus `room` per head
    assert ragged.kv_nbytes() == entry * (counts.sum() + cfg.num_layers * cfg.num_kv_heads * room)

    d, r = (kvjax.generate(stories, prompt, policy=policy, budget=48, max_new_tokens=N, stop_tokens=[],
                           cache_layout=layout) for layout in ("dense", "ragged"))
    assert d.cache_layout == "dense" and r.cache_layout == "ragged"
    np.testing.assert_array_equal(d.tokens, r.tokens)
    np.testing.assert_array_equal(d.kept_final, r.kept_final)
    np.testing.assert_allclose(d.kv_bytes_peak, r.kv_bytes_peak)
    assert r.cache_bytes == _expected_nbytes(layout, 1, cfg.num_kv_heads, cfg.head_dim, itemsize)
    assert r.cache_bytes < d.cache_bytes


@pytest.mark.parametrize("name", list(POLICIES))
def test_ragged_greedy_tokens_with_questions_and_a_batch(stories, name):
    policy, _ = POLICIES[name]
    prompts = [[1] + RNG.randint(3, 512, n - 1).tolist() for n in (180, 120)]
    questions = [RNG.randint(3, 512, n).tolist() for n in (5, 9)]
    d, r = (kvjax.generate(stories, prompts, questions=questions, policy=policy, compression_ratio=0.6,
                           max_new_tokens=N, stop_tokens=[], cache_layout=layout) for layout in ("dense", "ragged"))
    assert r.cache_layout == "ragged"
    np.testing.assert_array_equal(d.tokens, r.tokens)
    np.testing.assert_array_equal(d.kept_final, r.kept_final)
    assert r.cache_bytes < d.cache_bytes


def test_decode_time_policies_stay_dense(stories):
    prompt = [[1] + RNG.randint(3, 512, 99).tolist()]
    out = kvjax.generate(stories, prompt, policy="cake", budget=48, max_new_tokens=N, cache_layout="ragged")
    assert out.cache_layout == "dense"
    with pytest.raises(ValueError, match="cache_layout"):
        kvjax.generate(stories, prompt, policy="pyramidkv", budget=48, cache_layout="paged")


@pytest.mark.parametrize("name", ["pyramidkv", "ada_snapkv"])
def test_no_recompilation_within_a_bucket(stories, name):
    policy, _ = POLICIES[name]
    run = lambda n: kvjax.generate(stories, [[1] + RNG.randint(3, 512, n - 1).tolist()], policy=policy,
                                   budget=48, max_new_tokens=N, stop_tokens=[], cache_layout="ragged")
    run(200)
    before = dict(steps.TRACE_COUNTS)
    run(210)
    run(230)
    assert dict(steps.TRACE_COUNTS) == before


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_ragged_runs_sliding_window_and_soft_capped_models(tmp_path, family):
    """The ragged decode runs the dense layer code: Gemma's sliding-window layers (their rolling buffers
    carried along) and attention soft-caps decode in the ragged layout with the dense layout's tokens."""
    from tiny_models import build_hf

    build_hf(family, tmp_path)
    model = kvjax.load_model(tmp_path)
    prompts = [RNG.randint(3, model.config.vocab_size, n).tolist() for n in (150, 100)]
    for name in ("pyramidkv", "ada_snapkv"):
        d, r = (kvjax.generate(model, prompts, policy=name, compression_ratio=0.5, max_new_tokens=N, stop_tokens=[],
                               cache_layout=layout) for layout in ("dense", "ragged"))
        assert r.cache_layout == "ragged"
        np.testing.assert_array_equal(d.tokens, r.tokens)
        np.testing.assert_array_equal(d.kept_final, r.kept_final)


def test_ragged_decodes_on_a_mesh(stories_path, stories):
    """Over a data x model mesh the ragged layout gives the tokens of one device (rows over data)."""
    mesh = kvjax.make_mesh(data=2, model=2)
    sharded = kvjax.load_model(stories_path, mesh=mesh)
    prompts = [[1] + RNG.randint(3, 512, n - 1).tolist() for n in (180, 150)]
    one, many = (kvjax.generate(m, prompts, policy="ada_snapkv", budget=48, max_new_tokens=N, stop_tokens=[],
                                cache_layout="ragged") for m in (stories, sharded))
    assert many.cache_layout == "ragged"
    np.testing.assert_array_equal(one.tokens, many.tokens)
