"""Quantized storage in the ragged decode layout (kvjax.cache_quant_ragged): per-layer quantized storage
(a capacity per layer for layer-wise budgets, quantized per-head segments for head-wise ones) attends
exactly as the stacked quantized cache over the same entries, through appends and window flushes; stores
the bytes computed by hand from the kept counts and the configuration, fewer than the stacked one; and
`generate(..., kv_quant=..., cache_layout="ragged")` decodes the stacked quantized layout's tokens with
no recompilation across decode lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cache_quant, cache_quant_ragged
from kvjax.cache import KVCache
from kvjax.engine import api, steps
from kvjax.engine.api import Setting, generate_settings
from kvjax.kernels.attention import QuantizedSegmentedKeys, attention
from kvjax.kv_quant import KVQuant

RNG = np.random.RandomState(7)
# [L, B, Hkv]: layer 0 layer-wise (every head of a row keeps the same count), layer 1 head-wise (with an
# empty head), so the ragged layout has one dense and one segmented layer
COUNTS = np.array([[[9, 9], [5, 5]], [[12, 3], [0, 7]]])
ROOM = 16
CONFIGS = {
    "int8": KVQuant("int8"),  # window of 1: every append is quantized at once
    "int4_hadamard_r4": KVQuant("int4", rotation="hadamard", residual=4),
    "int4_kivi_g4_r8": KVQuant("int4", key_axis="channel", group=4, residual=8, asymmetric=True),
    "int4_r128": KVQuant("int4", rotation="hadamard", residual=128),  # a window wider than the room
}


# the conversions, compiled (eager dispatch of their many small ops is slow)
to_stacked = jax.jit(cache_quant.from_cache, static_argnums=1)
to_ragged = jax.jit(cache_quant_ragged.from_cache, static_argnums=(1, 2, 3))


def dense_cache(counts, room, D=16, dtype=jnp.float32):
    """A compressed dense cache: each head's `counts` entries first, in increasing (gapped) positions."""
    L, B, H = counts.shape
    C = int(counts.max()) + room
    valid = np.arange(C) < counts[..., None]
    pos = np.where(valid, np.cumsum(RNG.randint(1, 4, (L, B, H, C)), -1), -1).astype(np.int32)
    return KVCache(k=jnp.asarray(RNG.randn(L, B, H, C, D), dtype), v=jnp.asarray(RNG.randn(L, B, H, C, D), dtype),
                   pos=jnp.asarray(pos), valid=jnp.asarray(valid))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attends_as_the_stacked_quantized_cache_through_appends_and_flushes(name):
    """The same entries, quantized in the stacked cache and in the ragged layout: after every decode append
    (a padding step in row 1 now and then) each layer's attention output and log-sum-exp are the same
    (soft-capped or not), the windows flush
    at the same entries, and the rows' entries and bytes (codes + scales, window at 16 bits) agree."""
    config = CONFIGS[name]
    dense = dense_cache(COUNTS, ROOM)
    stacked = to_stacked(dense, config)
    layout = cache_quant_ragged.choose_layout(COUNTS, ROOM, config)
    assert [kind for kind, _ in layout] == ["dense", "segmented"]
    ragged = to_ragged(dense, layout, ROOM, config)
    assert isinstance(ragged.layer_keys(1), QuantizedSegmentedKeys)
    dense_layer, seg_layer = ragged.layers
    start = np.asarray(seg_layer.end) - ROOM - COUNTS[1]  # per-token keys: segments of count + room
    L, B, H = COUNTS.shape

    @jax.jit
    def step(stacked, ragged, k, v, p, q):  # one program for every step (fixed shapes)
        outs = []
        for l in range(L):
            stacked, ragged = stacked.write_layer(l, k, v, p), ragged.write_layer(l, k, v, p)
        for l in range(L):
            for cap in (None, 1.5):  # soft-capped logits (Gemma 2) too
                res = [attention(q, c.layer_keys(l), jnp.full((B, 1), 10_000, jnp.int32), scale=0.3, softcap=cap,
                                 returns=("lse",)) for c in (stacked, ragged)]
                outs += [(res[0].out, res[1].out), (res[0].lse, res[1].lse)]
        return stacked, ragged, outs

    for t in range(13):  # more appends than any residual here but the wide one
        k, v = (jnp.asarray(RNG.randn(B, H, 1, 16), jnp.float32) for _ in range(2))
        p = jnp.asarray([[1000 + t], [1000 + t if t % 3 else -1]], jnp.int32)
        q = jnp.asarray(RNG.randn(B, 8, 1, 16), jnp.float32)
        stacked, ragged, outs = step(stacked, ragged, k, v, p, q)
        for want, got in outs:
            assert np.abs(np.asarray(want)).max() > 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    dense_layer, seg_layer = ragged.layers
    np.testing.assert_array_equal(dense_layer.flushed, stacked.flushed[0])
    if config.key_axis == "token":
        np.testing.assert_array_equal(seg_layer.flushed - start, stacked.flushed[1])
    appended = np.array([13, 8])[:, None]  # per row
    R = max(config.residual, 1)
    G = config.slot_group if config.key_axis == "channel" else 1
    if R < ROOM:  # the windows flushed whole groups of R: what is left in them is below R
        window = np.asarray(dense_layer.fill - dense_layer.flushed)
        np.testing.assert_array_equal(window, (COUNTS[0] % G + appended) % R)
    np.testing.assert_array_equal(ragged.num_valid(), stacked.num_valid())
    np.testing.assert_array_equal(ragged.num_valid(), COUNTS + appended)
    np.testing.assert_allclose(ragged.row_kv_bytes(), stacked.row_kv_bytes(), rtol=1e-6)


def test_a_head_or_row_that_sees_nothing_gets_zeros():
    config = CONFIGS["int4_hadamard_r4"]
    counts = np.array([[[4, 0], [0, 0]]])
    dense = dense_cache(counts, ROOM)
    ragged = to_ragged(dense, cache_quant_ragged.choose_layout(counts, ROOM, config), ROOM, config)
    assert ragged.layout[0][0] == "segmented"
    attend = jax.jit(lambda keys: attention(jnp.ones((2, 4, 1, 16)), keys, jnp.full((2, 1), 500, jnp.int32),
                                            scale=0.3).out)
    out = np.asarray(attend(ragged.layer_keys(0)))
    assert np.isfinite(out).all() and np.abs(out[0, :2]).min() > 0
    np.testing.assert_array_equal(out[0, 2:], 0.0)  # head 1 of row 0 holds nothing
    np.testing.assert_array_equal(out[1], 0.0)  # row 1 holds nothing


def expected_nbytes(counts, room, config, D, itemsize, granule=1):
    """Every buffer of the quantized ragged layout, by hand: per layer, a capacity of the largest count + room
    per head (heads all equal) or segments of the largest row total + room per head (heads differ); codes,
    per-slot float16 scales (int8 zero points when asymmetric) for keys and values, the window of
    min(residual, room) entries per head in the model dtype, int32 positions (and segment ids), and int32
    write pointers and segment ends. Per-token scales only."""
    assert config.key_axis == "token"
    groups = D // (config.group or D)
    per_slot = 2 * (D * config.bits // 8 + groups * 2 + (groups if config.asymmetric else 0))
    W = min(max(config.residual, 1), room)
    total = 0
    for c in counts:
        B, H = c.shape
        most, row_total = int(c.max()), int(c.sum(-1).max())
        window = 2 * B * H * W * D * itemsize
        if row_total < H * most:
            S = -(-row_total // granule) * granule + H * room
            total += B * S * (per_slot + 8) + window + 3 * B * H * 4
        else:
            C = -(-most // granule) * granule + room
            total += B * H * C * (per_slot + 4) + window + 2 * B * H * 4
    return total


def test_bytes_are_the_kept_entries_plus_room_exactly():
    dense = dense_cache(COUNTS, ROOM)
    for config in (CONFIGS["int8"], CONFIGS["int4_r128"], KVQuant("int4", group=8, asymmetric=True, residual=4)):
        ragged = to_ragged(dense, cache_quant_ragged.choose_layout(COUNTS, ROOM, config), ROOM,
                                               config)
        assert ragged.nbytes() == expected_nbytes(COUNTS, ROOM, config, 16, 4)
        assert ragged.nbytes() < to_stacked(dense, config).nbytes()


def test_per_channel_segments_start_on_key_groups():
    """KIVI keys share a scale over G slots: every segment starts on a multiple of G, and the layout holds
    Hkv * (G - 1) more slots for it."""
    config = CONFIGS["int4_kivi_g4_r8"]
    layout = cache_quant_ragged.choose_layout(COUNTS, ROOM, config)
    total = int(COUNTS[1].sum(-1).max())
    assert layout[1] == ("segmented", -(-(total + 2 * (ROOM + 3)) // 4) * 4)
    seg = to_ragged(dense_cache(COUNTS, ROOM), layout, ROOM, config).layers[1]
    starts = np.asarray(seg.end) - np.diff(np.concatenate([np.zeros((2, 1), int), np.asarray(seg.end)], 1), axis=1)
    assert (starts % 4 == 0).all() and (np.asarray(seg.flushed) % 4 == 0).all()
    assert seg.k.scale.shape == (2, layout[1][1] // 4, 16)  # per channel, one per group of 4 slots


# ---- end to end ---------------------------------------------------------------------------------------------

N = 14  # generated tokens: 13 decode appends, more than a residual of 4


@pytest.fixture(scope="module")
def stories(stories_path):
    return kvjax.load_model(stories_path)


def _prompts(lengths):
    return [[1] + RNG.randint(3, 512, n - 1).tolist() for n in lengths]


@pytest.mark.parametrize("policy", ["pyramidkv", "ada_snapkv"])
def test_generate_gives_the_stacked_quantized_tokens_in_fewer_bytes(stories, policy, monkeypatch):
    """int8 and int4: the same greedy tokens as the stacked quantized layout with the same storage, the same
    bytes per row while decoding (the same entries quantized, the same in the window), and the cache holds
    exactly the bytes counted by hand from the kept counts and the configuration, fewer than the stacked."""
    monkeypatch.setattr(api, "RAGGED_GRANULE", 1)
    cfg = stories.config
    prompts = _prompts((200, 150))
    counts = np.asarray(kvjax.engine.compress(stories, prompts, policy=policy, budget=48).num_valid())
    heads_differ = any(bool((c != c[..., :1]).any()) for c in counts)  # head-wise: segmented layers
    assert heads_differ == (policy == "ada_snapkv")
    settings = [Setting(policy, budget=48, kv_quant=q) for q in ("int8", "int4")]
    dense = generate_settings(stories, prompts, settings, max_new_tokens=N, stop_tokens=[])
    ragged = generate_settings(stories, prompts, settings, max_new_tokens=N, stop_tokens=[],
                                     cache_layout="ragged")
    room = 16  # the decode-step bucket of N
    for st, d, r in zip(settings, dense, ragged):
        assert d.cache_layout == "quantized" and r.cache_layout == "ragged+quantized"
        np.testing.assert_array_equal(d.tokens, r.tokens)
        np.testing.assert_array_equal(d.kept_final, r.kept_final)
        np.testing.assert_allclose(d.kv_bytes16_peak, r.kv_bytes16_peak)
        np.testing.assert_allclose(d.kv_bytes16_mean, r.kv_bytes16_mean)
        itemsize = np.dtype(cfg.jnp_dtype).itemsize
        assert r.cache_bytes == expected_nbytes(counts, room, st.kv_quant, cfg.head_dim, itemsize)
        assert r.cache_bytes < d.cache_bytes


def test_windows_flush_across_decode_steps_and_nothing_recompiles(stories):
    """A residual of 4 under 13 appends: the windows flush three times while decoding (the bytes per row
    follow the flushes exactly), the tokens are the stacked quantized cache's, and other prompt lengths
    and decode lengths of the same buckets reuse every compiled program."""
    config = KVQuant("int4", rotation="hadamard", residual=4)
    cfg = stories.config
    prompts = _prompts((200, 170))
    kw = dict(policy="ada_snapkv", budget=48, stop_tokens=[], kv_quant=config)
    d = kvjax.generate(stories, prompts, max_new_tokens=N, **kw)
    r = kvjax.generate(stories, prompts, max_new_tokens=N, cache_layout="ragged", **kw)
    assert r.cache_layout == "ragged+quantized"
    np.testing.assert_array_equal(d.tokens, r.tokens)
    heads = cfg.num_layers * cfg.num_kv_heads
    kept = np.round(r.kept.astype(np.float64) * heads)  # entries per row after the prompt's compression
    q_entry, w_entry = cfg.head_dim + 4, 2 * cfg.head_dim * 2  # int4 codes + two float16 scales; 16-bit window
    per_step = [kept * q_entry + heads * (4 * (s // 4) * q_entry + (s % 4) * w_entry) for s in range(N)]
    np.testing.assert_allclose(r.kv_bytes16_peak, np.max(per_step, axis=0), rtol=1e-6)
    np.testing.assert_allclose(r.kv_bytes16_mean, np.mean(per_step, axis=0), rtol=1e-6)

    before = dict(steps.TRACE_COUNTS)
    for lengths, n in (((210, 160), 9), ((230, 190), 5)):
        out = kvjax.generate(stories, _prompts(lengths), max_new_tokens=n, cache_layout="ragged", **kw)
        assert out.cache_layout == "ragged+quantized" and out.tokens.shape == (2, n)
    assert dict(steps.TRACE_COUNTS) == before


def test_decode_time_policies_and_the_full_cache_keep_the_stacked_quantized_layout(stories):
    prompt = _prompts((100,))
    for policy, budget in (("h2o", 48), (None, None)):
        out = kvjax.generate(stories, prompt, policy=policy, budget=budget, max_new_tokens=4, kv_quant="int8",
                             cache_layout="ragged")
        assert out.cache_layout == "quantized"


def test_sliding_window_models_and_a_mesh(tmp_path, stories_path, stories):
    """Gemma 2 (rolling buffers carried in full precision, soft-capped attention) decodes the stacked quantized
    layout's tokens from quantized segments; over a data x model mesh the tokens are one device's."""
    from tiny_models import build_hf

    build_hf("gemma2", tmp_path)
    gemma = kvjax.load_model(tmp_path)
    prompts = [RNG.randint(3, gemma.config.vocab_size, n).tolist() for n in (150, 100)]
    kw = {"policy": "ada_snapkv", "compression_ratio": 0.5, "max_new_tokens": N, "stop_tokens": [],
          "kv_quant": KVQuant("int4", rotation="hadamard", residual=4)}
    d, r = (kvjax.generate(gemma, prompts, cache_layout=layout, **kw) for layout in ("dense", "ragged"))
    assert r.cache_layout == "ragged+quantized"
    np.testing.assert_array_equal(d.tokens, r.tokens)
    assert r.cache_bytes < d.cache_bytes

    sharded = kvjax.load_model(stories_path, mesh=kvjax.make_mesh(data=2, model=2))
    prompts = _prompts((180, 150))
    one, many = (kvjax.generate(m, prompts, policy="ada_snapkv", budget=48, max_new_tokens=8, stop_tokens=[],
                                kv_quant="int4", cache_layout="ragged") for m in (stories, sharded))
    assert many.cache_layout == "ragged+quantized"
    np.testing.assert_array_equal(one.tokens, many.tokens)
