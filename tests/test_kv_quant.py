"""Quantized KV storage: the quantizer against a NumPy reference (codes, round-trip bounds, packing, rotation),
the quantized layout's full-precision window and flush against a NumPy simulation, attention over it against
NumPy, exact bytes, errors; end to end: the same tokens as the dense cache at 16 bits, decode-time eviction on
quantized storage, no recompilation inside a bucket."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cache_quant, kv_quant
from kvjax.cache import KVCache
from kvjax.engine import steps
from kvjax.kernels.attention import attention
from kvjax.kv_quant import KVQuant

RNG = np.random.RandomState(0)
BOUND = {"int8": 127.5, "int4": 7.5, "int2": 1.5, "fp8": 448.0}
SIGNED = {"int8": (-128, 127), "int4": (-8, 7), "int2": (-2, 1)}


def _groups(x, g):
    """[..., S, D] -> [..., S, D/g, g]"""
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


@pytest.mark.parametrize("config", [KVQuant("int8"), KVQuant("int4", group=16), KVQuant("int2", group=32),
                                    KVQuant("int4", group=32, asymmetric=True), KVQuant("int2", asymmetric=True),
                                    KVQuant("int8", asymmetric=True), kv_quant.PRESETS["int8_g16"]])
def test_integer_codes_equal_numpy_and_round_trip_within_a_step(config):
    """Codes equal NumPy's rounding against the stored scale; a value comes back within half a step
    (symmetric; the scale is rounded up to float16, so nothing clips), or within one step (asymmetric:
    the zero point is rounded too)."""
    x = RNG.randn(2, 3, 40, 64).astype(np.float32) * np.linspace(0.2, 4, 64)  # outlier channels
    q = kv_quant.quantize(jnp.asarray(x), config)
    g = config.channel_group(64)
    s = np.asarray(q.scale, np.float32)  # the stored float16 scale, [.., S, D/g]
    xs = _groups(x, g) / s[..., None]
    lo, hi = SIGNED[config.format]
    if config.asymmetric:
        zero = np.asarray(q.zero, np.float32)
        want = np.clip(np.round(xs + zero[..., None]), lo, hi)
        groups = _groups(x, g)
        lo_x, hi_x = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)  # qwix's range (holds 0)
        np.testing.assert_allclose(s, (hi_x - lo_x) / (hi - lo), rtol=2e-3)
        assert (s >= (hi_x - lo_x) / (hi - lo) * (1 - 1e-7)).all()
    else:
        want = np.clip(np.round(xs), lo, hi)
        exact = np.abs(_groups(x, g)).max(-1) / BOUND[config.format]
        np.testing.assert_allclose(s, exact, rtol=2e-3)
        assert (s >= exact * (1 - 1e-7)).all()  # rounded up to float16
    codes = np.asarray(kv_quant.codes_of(q, config)).reshape(want.shape)
    np.testing.assert_array_equal(codes, want)
    deq = np.asarray(kv_quant.dequantize(q, config))
    step = np.repeat(s, g, axis=-1)
    if config == kv_quant.PRESETS["int8_g16"]:  # its point: the small channels' error shrinks with their groups
        whole = np.asarray(kv_quant.dequantize(kv_quant.quantize(jnp.asarray(x), KVQuant("int8")), KVQuant("int8")))
        assert np.abs(deq - x)[..., :16].mean() < 0.5 * np.abs(whole - x)[..., :16].mean()
    assert (np.abs(deq - x) <= (1.0 if config.asymmetric else 0.5) * step * (1 + 1e-4) + 1e-6).all()


def test_fp8_and_per_channel_keys():
    x = RNG.randn(1, 2, 64, 32).astype(np.float32) * np.linspace(0.1, 8, 32)
    q = kv_quant.quantize(jnp.asarray(x), KVQuant("fp8"))
    s = np.asarray(q.scale, np.float32)
    np.testing.assert_allclose(s[..., 0], np.abs(x).max(-1) / 448.0, rtol=2e-3)
    rel = np.abs(np.asarray(kv_quant.dequantize(q, KVQuant("fp8"))) - x) / np.maximum(np.abs(x), s)
    assert rel.max() < 2 ** -3  # e4m3: 3 mantissa bits
    cfg = KVQuant("int4", key_axis="channel", group=16, residual=32)
    qc = kv_quant.quantize(jnp.asarray(x), cfg, per_channel=True)
    assert qc.scale.shape == (1, 2, 4, 32)  # one scale per channel per 16 slots
    sc = np.asarray(qc.scale, np.float32)
    np.testing.assert_allclose(sc, np.abs(x.reshape(1, 2, 4, 16, 32)).max(3) / 7.5, rtol=2e-3)
    err = np.abs(np.asarray(kv_quant.dequantize(qc, cfg)) - x)
    assert (err <= 0.5 * np.repeat(sc, 16, axis=2) * (1 + 1e-3) + 1e-6).all()


@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_packing_layout_equals_numpy(fmt):
    bits = 8 // {"int4": 2, "int2": 4}[fmt]
    per = 8 // bits
    lo, hi = SIGNED[fmt]
    q = RNG.randint(lo, hi + 1, (3, 64))
    packed = np.asarray(kv_quant.pack(jnp.asarray(q), fmt))
    u = q - lo
    d = 64 // per
    want = sum(u[:, i * d:(i + 1) * d] << (bits * i) for i in range(per)).astype(np.uint8)
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(np.asarray(kv_quant.unpack(jnp.asarray(packed), fmt)), q)


def test_hadamard_rotation_keeps_dot_products():
    h = np.asarray(kv_quant.hadamard(64))
    np.testing.assert_allclose(h @ h, np.eye(64), atol=1e-6)
    q, k = RNG.randn(5, 64), RNG.randn(7, 64)
    cfg = KVQuant("int4", rotation="hadamard")
    qr, kr = (np.asarray(kv_quant.rotate(jnp.asarray(a, jnp.float32), cfg)) for a in (q, k))
    np.testing.assert_allclose(qr @ kr.T, q @ k.T, atol=1e-4)


def _dense(L=2, B=2, H=2, C=40, D=64, kept=(20, 13)):
    k = RNG.randn(L, B, H, C, D).astype(np.float32)
    v = RNG.randn(L, B, H, C, D).astype(np.float32)
    pos = np.full((L, B, H, C), -1, np.int32)
    for b, n in enumerate(kept):
        pos[:, b, :, :n] = np.arange(n)
    return KVCache(k=jnp.asarray(k), v=jnp.asarray(v), pos=jnp.asarray(pos), valid=jnp.asarray(pos >= 0))


@pytest.mark.parametrize("config", [KVQuant("int8", residual=4), KVQuant("int4", key_axis="channel", group=4,
                                                                        residual=8, asymmetric=True)])
def test_window_takes_appends_and_flushes_whole(config):
    """NumPy simulation of the window: each append lands at its head's next slot in full precision; when the
    window holds `residual` entries they are quantized into their slots at once, the window empties."""
    dense = _dense()
    qc = cache_quant.from_cache(dense, config)
    G = config.slot_group if config.key_axis == "channel" else 1
    fill = np.array([[20, 20], [13, 13]])
    flushed = fill // G * G
    np.testing.assert_array_equal(np.asarray(qc.fill[0]), fill)
    np.testing.assert_array_equal(np.asarray(qc.flushed[0]), flushed)
    written = {}
    for t in range(11):
        k = jnp.asarray(RNG.randn(2, 2, 1, 64).astype(np.float32))
        pos = jnp.asarray([[20 + t], [13 + t]], jnp.int32)
        for l in range(2):
            qc = qc.write_layer(l, k, k * 2, pos)
        for b in range(2):
            written[(b, fill[b, 0])] = np.asarray(k[b, :, 0])
        fill = fill + 1
        full = fill - flushed >= config.residual
        flushed = np.where(full, flushed + config.residual, flushed)
        np.testing.assert_array_equal(np.asarray(qc.fill[1]), fill)
        np.testing.assert_array_equal(np.asarray(qc.flushed[1]), flushed)
        for (b, slot), kk in written.items():
            assert int(qc.pos[1, b, 0, slot]) == slot and bool(qc.valid[1, b, 0, slot])
            if slot >= flushed[b, 0]:  # still in the window: exact
                np.testing.assert_array_equal(np.asarray(qc.rk[1, b, :, slot - flushed[b, 0]]), kk)
    keys = kv_quant.dequantize(jax.tree.map(lambda a: a[1], qc.k), config)
    for (b, slot), kk in written.items():
        if slot < flushed[b, 0]:  # flushed: its codes dequantize to it
            assert np.abs(np.asarray(keys[b, :, slot]) - kk).max() < (0.05 if config.format == "int8" else 0.8)


@pytest.mark.parametrize("preset", ["int8", "int8_g16", "int4_kivi", "int2_hadamard", "int4"])
def test_decode_attention_over_quantized_storage_equals_numpy(preset):
    """One decode step: the quantized slots (dequantized) and the window attended together as one softmax;
    the probabilities put the window's entries at their slots; a row that sees nothing gives zeros."""
    config = kv_quant.PRESETS[preset]
    config = dataclasses.replace(config, residual=8 if preset != "int8" else 0,
                                 group=4 if config.key_axis == "channel" else config.group)
    qc = cache_quant.from_cache(_dense(), config)
    for t in range(5):  # some appends in the window
        k = jnp.asarray(RNG.randn(2, 2, 1, 64).astype(np.float32))
        qc = qc.write_layer(0, k, -k, jnp.asarray([[20 + t], [-1]], jnp.int32))  # row 1: a padding step
    keys = qc.layer_keys(0)
    q = jnp.asarray(RNG.randn(2, 8, 1, 64).astype(np.float32))
    q_pos = jnp.asarray([[30], [-1]], jnp.int32)
    res = attention(q, keys, q_pos, scale=0.125, returns=("probs",))
    kd = np.asarray(kv_quant.rotate(kv_quant.dequantize(keys.k, config), config))
    vd = np.asarray(kv_quant.rotate(kv_quant.dequantize(keys.v, config), config))
    S = keys.pos.shape[-1]
    kk, vv = kd[:, :, :S].copy(), vd[:, :, :S].copy()
    rslot = np.asarray(keys.rslot)
    for b in range(2):
        for h in range(2):
            for j, s in enumerate(rslot[b, h]):
                if s >= 0:
                    kk[b, h, s], vv[b, h, s] = np.asarray(keys.rk[b, h, j]), np.asarray(keys.rv[b, h, j])
    pos = np.where(rslot >= 0, 0, 0)  # noqa: F841
    seen = np.asarray(qc.valid[0]) & (np.asarray(qc.pos[0]) <= 30)
    qq = np.asarray(q[:, :, 0]).reshape(2, 2, 4, 64)
    logits = np.einsum("bhgd,bhsd->bhgs", qq, kk) * 0.125
    logits = np.where(seen[:, :, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True, initial=-1e30))
    p = np.where(seen[:, :, None], p, 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
    out = np.einsum("bhgs,bhsd->bhgd", p, vv).reshape(2, 8, 64)
    np.testing.assert_allclose(np.asarray(res.out[0, :, 0]), out[0], atol=2e-4)
    np.testing.assert_allclose(np.asarray(res.probs[0, :, :, 0]), p[0], atol=2e-5)
    assert not np.asarray(res.out[1]).any() and not np.asarray(res.probs[1]).any()  # row 1 sees nothing
    assert np.isfinite(np.asarray(res.out)).all()


def test_bytes_are_the_buffers_exactly():
    config = KVQuant("int4", group=32, asymmetric=True, residual=8)
    qc = cache_quant.from_cache(_dense(), config)
    L, B, H, C, D = 2, 2, 2, 40, 64
    codes, scales, zeros = L * B * H * C * D // 2, L * B * H * C * (D // 32) * 2, L * B * H * C * (D // 32)
    window = 2 * L * B * H * 8 * D * 4  # float32 here
    meta = L * B * H * C * (4 + 1) + 2 * L * B * H * 4  # pos, valid, fill, flushed
    assert qc.nbytes() == 2 * (codes + scales + zeros) + window + meta


def test_bad_configurations_are_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="kv_quant group=96 must divide head_dim=64"):
        KVQuant("int4", group=96).check(64)
    with pytest.raises(ValueError, match="rotation='hadamard' is for int4 and int2"):
        KVQuant("int8", rotation="hadamard")
    with pytest.raises(ValueError, match="multiple of its slot group"):
        KVQuant("int4", key_axis="channel", group=32, residual=40)
    with pytest.raises(ValueError, match="kv_quant: .*one of .*'int4'"):
        kvjax.generate(kvjax.load_model("bundled"), [[1, 5, 6]], kv_quant="int3", max_new_tokens=2)


@pytest.fixture(scope="module")
def bundled():
    return kvjax.load_model("bundled")


def _prompts(model, lengths, seed=1):
    rng = np.random.RandomState(seed)
    return [[1] + rng.randint(3, model.config.vocab_size, n - 1).tolist() for n in lengths]


def test_sixteen_bit_storage_gives_the_dense_tokens():
    """bfloat16 storage through the quantized layout (window, flushes, merged attention) decodes a bfloat16
    model exactly as its dense cache does, with and without eviction."""
    model = kvjax.load_model("bundled", dtype="bfloat16")
    prompts = _prompts(model, (150, 90))
    for policy, ratio in ((None, None), ("snapkv", 0.5), ("h2o", 0.5)):
        dense = kvjax.generate(model, prompts, policy=policy, compression_ratio=ratio, max_new_tokens=20,
                               stop_tokens=[])
        quant = kvjax.generate(model, prompts, policy=policy, compression_ratio=ratio, max_new_tokens=20,
                               stop_tokens=[], kv_quant=KVQuant("bf16", residual=8))
        assert quant.cache_layout == "quantized"
        np.testing.assert_array_equal(dense.tokens, quant.tokens)
        np.testing.assert_array_equal(dense.kept_final, quant.kept_final)


def test_decode_time_eviction_and_stats_on_quantized_storage(bundled):
    prompts = _prompts(bundled, (300, 200))
    out = kvjax.generate(bundled, prompts, policy="h2o", budget=64, max_new_tokens=24, stop_tokens=[],
                         kv_quant="int8")
    assert out.cache_layout == "quantized"
    np.testing.assert_allclose(out.kept_final, 64 + 1, atol=1)  # H2O evicts back to its budget every step
    full = kvjax.generate(bundled, prompts, policy="h2o", budget=64, max_new_tokens=24, stop_tokens=[])
    per_entry16 = 2 * bundled.config.head_dim * 2
    np.testing.assert_allclose(full.kv_bytes16_mean, full.kept_mean * per_entry16 * 4 * 2, rtol=1e-6)
    assert (out.kv_bytes16_mean < 0.6 * full.kv_bytes16_mean).all()  # int8 codes + one scale per entry


def test_decode_time_capacity_is_the_dense_runs_with_per_token_scales(bundled, monkeypatch):
    """H2O at budget 40 over 24 decode steps: per-token scales (int4) reuse freed slots, so the quantized
    cache has the dense run's capacity; per-channel key groups (int4_kivi) need consecutive slots and get
    one more per decode step."""
    prompts = _prompts(bundled, (300, 200))
    decode, capacity = steps.decode, {}

    def record(params, cache, *args, **kwargs):
        capacity[getattr(cache, "config", None) and cache.config.name] = cache.capacity
        return decode(params, cache, *args, **kwargs)

    monkeypatch.setattr(steps, "decode", record)
    for quant in (None, "int4", "int4_kivi"):
        kvjax.generate(bundled, prompts, policy="h2o", budget=40, max_new_tokens=24, stop_tokens=[], kv_quant=quant)
    assert capacity["int4"] == capacity[None] < 64
    assert capacity["int4_kivi"] >= capacity[None] + 24 - 1


def test_no_recompilation_within_a_bucket(bundled):
    run = lambda n: kvjax.generate(bundled, _prompts(bundled, (n,), seed=n), policy="snapkv", compression_ratio=0.5,  # noqa: E731
                                   max_new_tokens=8, stop_tokens=[], kv_quant="int4")
    run(200)
    before = dict(steps.TRACE_COUNTS)
    run(220)
    run(240)
    assert dict(steps.TRACE_COUNTS) == before


@pytest.mark.parametrize("config", [KVQuant("int2", residual=128),
                                    KVQuant("int2", key_axis="channel", group=8, residual=64, asymmetric=True)])
def test_window_is_sized_to_the_decode_room(bundled, monkeypatch, config):
    """The stacked quantized cache's full-precision window holds what decoding can append and no more
    (room entries per token; per-channel keys: the partial group left over plus room, rounded up to whole
    groups), and decodes the tokens of the same run with the configuration's whole `residual` window
    (int2: rounding large enough that an early flush would change them)."""
    prompts = _prompts(bundled, (150, 90))
    to_quantized, seen = steps.to_quantized, []

    def whole_window(cache, *, config, room=None, reuse_slots=False):
        seen.append(room)
        out = to_quantized(cache, config=config, room=None, reuse_slots=reuse_slots)
        seen.append(out.rk.shape[-2])
        return out

    sized = kvjax.generate(bundled, prompts, policy="snapkv", compression_ratio=0.5, max_new_tokens=20,
                           stop_tokens=[], kv_quant=config)
    monkeypatch.setattr(steps, "to_quantized", whole_window)
    whole = kvjax.generate(bundled, prompts, policy="snapkv", compression_ratio=0.5, max_new_tokens=20,
                           stop_tokens=[], kv_quant=config)
    room, whole_w = seen[0], seen[1]  # (one call per batch of rows)
    assert whole_w == config.residual and room >= 20
    G = config.slot_group if config.key_axis == "channel" else 1
    want = room if G == 1 else -(-(G - 1 + room) // G) * G
    assert want < config.residual
    dense = kvjax.engine.compress(bundled, prompts, policy="snapkv", compression_ratio=0.5)
    assert to_quantized(dense, config=config, room=room).rk.shape[-2] == want
    assert cache_quant.window_size(config, room) == want
    assert cache_quant.window_size(config, None) == config.residual
    np.testing.assert_array_equal(sized.tokens, whole.tokens)
    assert sized.cache_bytes < whole.cache_bytes


def test_slot_reuse_writes_freed_slots_and_flushes_them():
    """Decode-time eviction with per-token scales (`reuse_slots`), against a NumPy simulation: each append
    takes its head's first slot that is neither valid nor in the window, an entry evicted while in the
    window frees its slot at once (a hole the flush skips), a full window is quantized into its entries'
    own slots; attention's key set is the valid coded slots plus the window's live entries. Capacity 24
    for 20 kept entries and 11 appends: without reuse the appends would run out of slots."""
    config = KVQuant("int8", residual=4)
    L, B, H, C, D = 2, 2, 2, 24, 64
    qc = cache_quant.from_cache(_dense(C=C, kept=(20, 13)), config, reuse_slots=True)
    assert qc.capacity == C and qc.window == 4
    rng = np.random.RandomState(3)
    valid = np.asarray(qc.valid).copy()
    windowed = np.zeros_like(valid)
    wslot = np.full((L, B, H, 4), -1)
    count = np.zeros((L, B, H), int)
    keys = {}  # (l, b, h, slot) -> the key written there last
    for t in range(11):
        k = rng.randn(B, H, 1, D).astype(np.float32)
        pos = np.array([[20 + t], [13 + t]], np.int32)
        slots = np.asarray(qc.write_slots(1))
        for l in range(L):
            qc = qc.write_layer(l, jnp.asarray(k), jnp.asarray(k), jnp.asarray(pos))
        for l, b, h in np.ndindex(L, B, H):
            s = int(np.flatnonzero(~(valid[l, b, h] | windowed[l, b, h]))[0])
            assert slots[l, b, h, 0] == s
            valid[l, b, h, s] = windowed[l, b, h, s] = True
            wslot[l, b, h, count[l, b, h]] = s
            count[l, b, h] += 1
            keys[(l, b, h, s)] = k[b, h, 0]
            if count[l, b, h] == 4:  # flush: the window's live entries become codes in their slots
                windowed[l, b, h, wslot[l, b, h][wslot[l, b, h] >= 0]] = False
                wslot[l, b, h], count[l, b, h] = -1, 0
        # evict one random valid slot per head (a window entry now and then)
        keep = np.ones((L, B, H, C), bool)
        for l, b, h in np.ndindex(L, B, H):
            keep[l, b, h, rng.choice(np.flatnonzero(valid[l, b, h]))] = False
        qc = qc.evict(jnp.asarray(keep))
        for l, b, h in np.ndindex(L, B, H):
            gone = ~keep[l, b, h]
            valid[l, b, h] &= ~gone
            windowed[l, b, h] &= ~gone
            wslot[l, b, h] = np.where(np.isin(wslot[l, b, h], np.flatnonzero(gone)), -1, wslot[l, b, h])
        np.testing.assert_array_equal(np.asarray(qc.valid), valid)
        np.testing.assert_array_equal(np.asarray(qc.windowed), windowed)
        np.testing.assert_array_equal(np.asarray(qc.wslot), wslot)
    deq = np.asarray(kv_quant.dequantize(qc.k, config))
    rk = np.asarray(qc.rk)
    seen = {"window": 0, "codes": 0}
    for (l, b, h, s), kk in keys.items():
        if not valid[l, b, h, s]:
            continue
        if windowed[l, b, h, s]:  # in the window: exact, at the entry that stands for it
            j = int(np.flatnonzero(wslot[l, b, h] == s)[0])
            np.testing.assert_array_equal(rk[l, b, h, j], kk)
            seen["window"] += 1
        else:  # flushed into its own slot
            assert np.abs(deq[l, b, h, s] - kk).max() < 0.05
            seen["codes"] += 1
    assert seen["window"] and seen["codes"]
    assert any(s < 20 for (l, b, h, s) in keys)  # appends did reuse slots freed below the prompt's entries
    view = qc.layer_keys(1)
    np.testing.assert_array_equal(np.asarray(view.rslot), wslot[1])
    live = (wslot[1] >= 0)
    want_rpos = np.where(live, np.take_along_axis(np.asarray(qc.pos[1]), np.maximum(wslot[1], 0), -1), -1)
    np.testing.assert_array_equal(np.asarray(view.rpos), want_rpos)
    np.testing.assert_array_equal(np.asarray(view.pos) >= 0, valid[1] & ~windowed[1])
    with pytest.raises(ValueError, match="slot reuse needs per-token scales"):
        cache_quant.from_cache(_dense(), KVQuant("int4", key_axis="channel", group=4, residual=8), reuse_slots=True)
