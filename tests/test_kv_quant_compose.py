"""Quantized KV storage (`generate(..., kv_quant=...)`) composed with the rest of kvjax: every registered
policy, uniform compaction, chunked prefill, a data x model mesh, Gemma's sliding-window layers, LookaheadKV
and both question protocols.

What composing means, and what each test holds to:
- prefill-only policies score and compact in full precision, and only then are the kept entries quantized,
  once: the kept slots equal those of the unquantized run, and the stored codes are those of the
  unquantized run's kept keys and values (each within half a quantization step of them);
- decode-time policies (H2O, TOVA, CAKE, LazyEviction) evict on the attention that decoding computes, which
  reads the dequantized codes: the run equals a run on a dense cache whose entries were replaced by their
  dequantized values (and, at 2 bits, differs from the full-precision run); their dense plan of about
  budget + 1 slots is given room for every decode append, which the quantized layout writes at each
  head's next slot;
- bfloat16 storage (the "bf16" preset) of a bfloat16 model gives the unquantized tokens;
- int8's first-step logits stay within the first-order bound of its rounding (see the test);
- policies that re-rotate keys at every step (rope_mode "cache_relative") are refused at planning.

The engine's caches are read by wrapping `steps.to_quantized` and `steps.decode` (`_Capture`). Every test but
Gemma's uses the bundled model (float32, or bfloat16 where tokens must match exactly) on prompts of one
bucket and one decode-step bucket, so that the compiled programs are shared between tests. The fast suite
runs one prefill-only and one decode-time policy; the slow one every registered policy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cache_quant, kv_quant, policies
from kvjax.cache import KVCache
from kvjax.engine import STEP_BUCKETS, Setting, bucket_length, steps
from kvjax.kv_quant import KVQuant
from kvjax.models import extend

RATIO = 0.5
LENGTHS = (100, 70)  # one prompt bucket (128)
MAX_NEW = 12  # one decode-step bucket (16)
ROOM = bucket_length(MAX_NEW, STEP_BUCKETS)
DECODE_BUDGET = 48  # decode-time policies: a budget, whose dense capacity (about budget + 1) the appends outgrow
# LazyEviction's default window (175) exceeds these prompts (as in tests/test_policies_engine.py)
OVERRIDES = {"lazy_eviction": dict(window=8)}


def _policy(name):
    return policies.get(name, **OVERRIDES.get(name, {}))


def _kind(name):
    p = _policy(name)
    if p.requirements().rope_mode != "original":
        return "refused"
    return "decode" if p.decode_time else "prefill"


NAMES = policies.available()
PREFILL = [n for n in NAMES if _kind(n) == "prefill"]
DECODE = [n for n in NAMES if _kind(n) == "decode"]
REFUSED = [n for n in NAMES if _kind(n) == "refused"]
# one prefill-only and one decode-time policy in the fast suite, every other one in the slow suite
FAST = {"snapkv", "h2o"}


def _params(names):
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.fixture(scope="module")
def bundled():
    return kvjax.load_model("bundled")


@pytest.fixture(scope="module")
def bundled16():
    return kvjax.load_model("bundled", dtype="bfloat16")


def _prompts(model, lengths=LENGTHS, seed=1):
    rng = np.random.RandomState(seed)
    return [[1] + rng.randint(3, model.config.vocab_size, n - 1).tolist() for n in lengths]


def _run(model, prompts, name=None, **kw):
    kw = {"compression_ratio": RATIO, **kw} if name is not None and "budget" not in kw else kw
    return kvjax.generate(model, prompts, policy=None if name is None else _policy(name), max_new_tokens=MAX_NEW,
                          stop_tokens=[], **kw)


class _Capture:
    """Records what `generate` builds: the dense cache each run hands to `to_quantized` (`dense`) and the
    quantized cache it gets back (`quantized`), the cache each decode loop starts from (`start`) and ends
    with (`end`), all fetched to the host (before the decode loop donates them)."""

    def __init__(self, monkeypatch, replace=None):
        self.dense, self.quantized, self.start, self.end, self.shardings = [], [], [], [], []
        self.rooms = []
        to_quantized, decode = steps.to_quantized, steps.decode

        def wrapped_to_quantized(cache, *, config, room=None, reuse_slots=False):
            out = to_quantized(cache, config=config, room=room, reuse_slots=reuse_slots)
            self.rooms.append(room)
            self.dense.append(jax.device_get(cache))
            self.quantized.append(jax.device_get(out))
            self.shardings.append(out.k.codes.sharding)
            return out if replace is None else replace(out)

        def wrapped_decode(params, cache, *args, **kwargs):
            self.start.append(jax.device_get(cache))
            final = decode(params, cache, *args, **kwargs)
            self.end.append(jax.device_get(final.cache))
            return final

        monkeypatch.setattr(steps, "to_quantized", wrapped_to_quantized)
        monkeypatch.setattr(steps, "decode", wrapped_decode)


def _kept(cache) -> dict:
    """{(layer, row, head): sorted kept positions} of a dense or quantized cache."""
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    return {idx: sorted(pos[idx][valid[idx]].tolist()) for idx in np.ndindex(pos.shape[:3])}


def _by_position(cache, values) -> dict:
    """{(layer, row, head, position): values[..., slot, :]} over the valid slots (values [L,B,Hkv,C,...])."""
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    return {(*idx[:3], int(pos[idx])): np.asarray(values[idx]) for idx in zip(*np.nonzero(valid))}


def _by_position_equal(ca, xa, cb, xb) -> bool:
    a, b = _by_position(ca, np.asarray(xa)), _by_position(cb, np.asarray(xb))
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _dequantized(qc: cache_quant.QuantizedKVCache) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values [L,B,Hkv,C,D] a quantized cache holds, un-rotated: the dequantized codes of its
    quantized slots, the window's entries (full precision) at their slots."""
    cfg, C = qc.config, qc.capacity
    out = []
    for q, window in ((qc.k, qc.rk), (qc.v, qc.rv)):
        x = np.array(kv_quant.rotate(kv_quant.dequantize(q, cfg), cfg))[:, :, :, :C].astype(np.float32)
        fill, flushed = np.asarray(qc.fill), np.asarray(qc.flushed)
        for idx in np.ndindex(fill.shape):
            for j in range(fill[idx] - flushed[idx]):
                x[idx][flushed[idx] + j] = np.asarray(window[idx][j], np.float32)
        out.append(x)
    return out[0], out[1]


def _as_dense(qc: cache_quant.QuantizedKVCache) -> KVCache:
    """A dense cache holding what `qc` holds (its dequantized entries, in the model dtype's place: float32)."""
    k, v = _dequantized(jax.device_get(qc))
    return KVCache(k=jnp.asarray(k), v=jnp.asarray(v), pos=qc.pos, valid=qc.valid, local=qc.local)


def _step_bound(qc: cache_quant.QuantizedKVCache, q: kv_quant.Quantized) -> np.ndarray:
    """Half a quantization step per element, [L,B,Hkv,C,D] (symmetric per-token scales)."""
    s = np.asarray(q.scale, np.float32)[:, :, :, : qc.capacity]
    D = np.asarray(qc.rk).shape[-1]
    return 0.5 * np.repeat(s, D // s.shape[-1], axis=-1)


# ----------------------------------------------------------------------------- every registered policy


@pytest.mark.parametrize("name", _params(PREFILL))
def test_prefill_policy_keeps_its_full_precision_selection_and_quantizes_it_once(bundled, monkeypatch, name):
    """int4 (Hadamard, a scale per slot and head): the kept entries are those of the unquantized
    compression (scored in full precision), and the codes are exactly the quantization of its kept keys and
    values, each within half a step of them (rounded once, from full precision)."""
    config = kv_quant.PRESETS["int4"]
    prompts = _prompts(bundled)
    dense = jax.device_get(kvjax.engine.compress(bundled, prompts, policy=_policy(name), compression_ratio=RATIO))
    cap = _Capture(monkeypatch)
    quant = _run(bundled, prompts, name, kv_quant="int4")
    assert quant.cache_layout == "quantized"
    qc = cap.quantized[0]
    assert _kept(qc) == _kept(dense)
    valid = np.asarray(qc.valid) & (np.arange(qc.capacity) < np.asarray(qc.flushed)[..., None])
    assert valid.sum() == np.asarray(qc.valid).sum()  # every kept entry was quantized (per-token scales)
    ref = jax.device_get(cache_quant.from_cache(dense, config))  # the unquantized kept entries, quantized
    for field in ("k", "v"):
        got, want = getattr(qc, field), getattr(ref, field)
        assert _by_position_equal(qc, got.codes, dense, want.codes), field
        assert _by_position_equal(qc, got.scale, dense, want.scale), field
        x = _by_position(dense, np.asarray(kv_quant.rotate(jnp.asarray(getattr(dense, field)), config)))
        deq = _by_position(qc, np.asarray(kv_quant.dequantize(got, config))[:, :, :, : qc.capacity])
        half = _by_position(qc, _step_bound(qc, got))
        assert all((np.abs(deq[p] - x[p]) <= half[p] * (1 + 1e-4) + 1e-6).all() for p in x), field
    np.testing.assert_allclose(quant.kept, np.asarray(dense.valid).sum(-1).mean(axis=(0, 2)), rtol=1e-6)


@pytest.mark.parametrize("name", _params(DECODE))
def test_decode_time_policy_evicts_on_the_dequantized_keys(bundled, monkeypatch, name):
    """int2 (naive group-wise: large errors), the window holding every decode token: the tokens and the
    entries kept at the end equal those of the same run over a dense cache whose entries were replaced by
    their dequantized values, and differ from the full-precision run's (so the comparison can fail). A budget
    of 48 per head: the quantized cache has the dense plan's capacity (about budget + 1), each decode
    append reusing a slot an eviction freed (per-token scales)."""
    prompts = _prompts(bundled)
    assert kv_quant.PRESETS["int2"].residual >= ROOM  # decode appends stay in full precision, as in the dense run
    cap = _Capture(monkeypatch)
    quant = _run(bundled, prompts, name, budget=DECODE_BUDGET, kv_quant="int2")
    full = _run(bundled, prompts, name, budget=DECODE_BUDGET)
    monkeypatch.undo()
    ref_cap = _Capture(monkeypatch, replace=_as_dense)
    ref = _run(bundled, prompts, name, budget=DECODE_BUDGET, kv_quant="int2")
    assert isinstance(ref_cap.end[0], KVCache) and isinstance(cap.end[0], cache_quant.QuantizedKVCache)
    assert cap.start[0].reuses_slots and cap.start[0].capacity == cap.start[1].capacity
    np.testing.assert_array_equal(quant.tokens, ref.tokens)
    assert _kept(cap.end[0]) == _kept(ref_cap.end[0])
    np.testing.assert_array_equal(quant.kept_final, ref.kept_final)
    np.testing.assert_array_equal(quant.kept_final, full.kept_final)
    assert _kept(cap.start[0]) == _kept(cap.start[1])  # the prefill selection is the full-precision one
    assert (full.tokens != ref.tokens).any() or _kept(cap.end[1]) != _kept(ref_cap.end[0])


@pytest.mark.parametrize("name", REFUSED)
def test_cache_relative_policies_are_refused_at_planning(bundled, name):
    """streaming_llm re-rotates keys at their rank at every step, which quantized storage does not do:
    refused before any prefill, naming kv_quant, the rope mode and the way out; with on_error="return"
    the other settings still run."""
    prompts = _prompts(bundled)
    match = (rf"policy '{name}' at compression_ratio=0.5: kv_quant='int4' stores keys rotated at their positions.*"
             r"rope_mode 'cache_relative'.*run it with kv_quant=None")
    before = dict(steps.TRACE_COUNTS)
    with pytest.raises(ValueError, match=match):
        _run(bundled, prompts, name, kv_quant="int4")
    assert dict(steps.TRACE_COUNTS) == before  # refused at planning: nothing compiled or run
    bad, ok = kvjax.engine.generate_settings(bundled, prompts, [Setting(name, RATIO), Setting("snapkv", RATIO)],
                                             kv_quant="int4", max_new_tokens=MAX_NEW, stop_tokens=[],
                                             on_error="return")
    assert isinstance(bad, ValueError) and "cache_relative" in str(bad)
    assert ok.cache_layout == "quantized"


@pytest.mark.slow
def test_sixteen_bit_storage_gives_the_unquantized_tokens_for_every_policy(bundled16):
    """The "bf16" preset (bfloat16 codes, scale 1, a 128-entry window) on a bfloat16 model: every policy
    (but the refused ones) decodes the unquantized run's tokens and keeps as much."""
    prompts = _prompts(bundled16)
    names = PREFILL + DECODE
    settings = [Setting(_policy(n), RATIO) for n in names]
    full = kvjax.engine.generate_settings(bundled16, prompts, settings, max_new_tokens=MAX_NEW, stop_tokens=[])
    quant = kvjax.engine.generate_settings(bundled16, prompts, settings, max_new_tokens=MAX_NEW, stop_tokens=[],
                                           kv_quant="bf16")
    for n, f, q in zip(names, full, quant):
        assert q.cache_layout == "quantized", n
        np.testing.assert_array_equal(q.tokens, f.tokens, err_msg=n)
        np.testing.assert_array_equal(q.kept_final, f.kept_final, err_msg=n)


def test_decode_time_eviction_writes_every_token_into_freed_slots(bundled16, monkeypatch):
    """H2O plans a dense cache of budget + 1 slots, each write reusing the slot an eviction freed; the
    quantized layout (per-token scales) does the same: the same 41 slots however many tokens are decoded
    (16 decode steps here, more than the one free slot). Every generated token is written and attended:
    bf16 storage gives the dense run's tokens, and each head ends holding the last token (H2O protects
    its recent half)."""
    prompts = _prompts(bundled16)
    cap = _Capture(monkeypatch)
    full = _run(bundled16, prompts, "h2o", budget=40)
    quant = _run(bundled16, prompts, "h2o", budget=40, kv_quant="bf16")
    np.testing.assert_array_equal(quant.tokens, full.tokens)
    np.testing.assert_allclose(quant.kept_final, 40)
    end = cap.end[-1]
    assert cap.start[0].capacity == 41 and end.capacity == 41 and end.reuses_slots and ROOM > 1
    newest = np.asarray(end.pos).max(-1)
    np.testing.assert_array_equal(newest, np.broadcast_to(np.asarray(LENGTHS)[None, :, None] + MAX_NEW - 2,
                                                          newest.shape))


# ----------------------------------------------------------------------------- int8's first-step logits


@functools.partial(jax.jit, static_argnames=("cfg",))
def _step_logits(params, cache, tokens, positions, *, cfg):
    return extend(params, cfg, cache, tokens, positions, fresh=False)[0][:, 0]


def test_int8_first_step_logits_within_the_first_order_rounding_bound(bundled):
    """int8 (symmetric absmax, a float16 scale s per slot and head, rounded up) stores every kept key and
    value element x as x' = x + e with |e| <= s / 2. To first order the first decode step's logit j moves by
    g_j . e (g_j = d logit_j / d x on the full-precision cache), hence two tolerances:
    - worst case: |logit'_j - logit_j| <= sum |g_j| * s / 2 over the quantized elements (the second-order
      rest is O((s/2)^2), about 1/255 of the first-order term here: 10% covers it);
    - typical: rounding errors spread uniformly over [-s/2, s/2] and independently, so g_j . e is close to
      normal with sigma_j^2 = sum g_j^2 s^2 / 12; |logit'_j - logit_j| <= 6 sigma_j (the most perturbed of
      2560 logits sits near 4 sigma). Here it is about 10x tighter than the worst case.
    Checked for each row's top logit and its most perturbed logit.

    The int8 format with a full-precision window for decode appends (as the int4 / int2 presets have), so
    that the new token attends to its own key in full precision in both runs; the "int8" preset (no window)
    also rounds the appended token before it is attended, outside these bounds over the prompt's entries.
    Also: the quantized cache gives the logits of a dense cache holding its dequantized entries (attention
    reads the codes and nothing else), and int8 does move the logits (the bounds are not met trivially)."""
    model, config = bundled, KVQuant("int8", residual=ROOM)
    cfg = model.config
    prompts = _prompts(model)
    dense = kvjax.engine.compress(model, prompts, policy="snapkv", compression_ratio=RATIO)
    qc = steps.to_quantized(dense, config=config)
    tokens = jnp.asarray([[17], [23]], jnp.int32)
    positions = jnp.asarray(LENGTHS, jnp.int32)[:, None]
    full = np.asarray(_step_logits(model.params, dense, tokens, positions, cfg=cfg))
    quant = np.asarray(_step_logits(model.params, qc, tokens, positions, cfg=cfg))
    deq = np.asarray(_step_logits(model.params, _as_dense(qc), tokens, positions, cfg=cfg))
    np.testing.assert_allclose(quant, deq, atol=1e-4, rtol=0)

    def logits_of(k, v):
        c = dense.replace(k=k, v=v)
        return extend(model.params, cfg, c, tokens, positions, fresh=False, differentiable=True)[0][:, 0]

    _, vjp = jax.vjp(logits_of, dense.k, dense.v)
    diff = np.abs(quant - full)
    picks = [(b, j) for b in range(2) for j in (int(full[b].argmax()), int(diff[b].argmax()))]
    basis = np.zeros((len(picks), *full.shape), np.float32)
    for i, (b, j) in enumerate(picks):
        basis[i, b, j] = 1.0
    gk, gv = jax.jit(jax.vmap(vjp))(jnp.asarray(basis))
    quantized = np.asarray(dense.valid) & (np.arange(qc.capacity) < np.asarray(qc.flushed)[..., None])
    assert quantized.sum() == np.asarray(dense.valid).sum()
    half_k = np.where(quantized[..., None], _step_bound(qc, qc.k), 0.0)
    half_v = np.where(quantized[..., None], _step_bound(qc, qc.v), 0.0)
    for i, (b, j) in enumerate(picks):
        g = np.concatenate([np.asarray(gk[i]).ravel(), np.asarray(gv[i]).ravel()])
        half = np.concatenate([half_k.ravel(), half_v.ravel()])
        worst = (np.abs(g) * half).sum()
        sigma = np.sqrt((g ** 2 * (2 * half) ** 2).sum() / 12)
        assert diff[b, j] <= 1.1 * worst + 1e-5, (b, j, diff[b, j], worst)
        assert diff[b, j] <= 6 * sigma + 1e-4, (b, j, diff[b, j], sigma)
    assert diff.max() > 1e-3  # int8 did move the logits


# ----------------------------------------------------------------------------- compaction, chunks, mesh


def test_uniform_compaction_quantizes_the_compacted_buffer(bundled, monkeypatch):
    """snapkv at a uniform budget compacts into budget + decode room slots; that buffer is what gets
    quantized: its bytes are the int8 codes and one float16 scale per slot and head, plus the one-entry
    window (the "int8" preset has no full-precision window: R = 1)."""
    prompts = _prompts(bundled)
    cap = _Capture(monkeypatch)
    out = _run(bundled, prompts, "snapkv", budget=48, kv_quant="int8")
    qc = cap.quantized[0]
    cfg = bundled.config
    L, B, H, D = cfg.num_layers, len(prompts), cfg.num_kv_heads, cfg.head_dim
    assert qc.capacity == 48 + ROOM and qc.k.codes.dtype == np.int8 and qc.k.scale.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(qc.valid).sum(-1), 48)
    np.testing.assert_array_equal(qc.flushed, 48)  # every kept entry quantized
    np.testing.assert_allclose(out.kept, 48)
    entry = 2 * (D + 2)  # key and value: D int8 codes + a float16 scale
    assert qc.kv_nbytes() == L * B * H * (48 + ROOM) * entry + 2 * L * B * H * 1 * D * 4  # + the float32 window
    assert out.cache_bytes == qc.nbytes()
    dense = KVCache.init(L, B, H, 48 + ROOM, D, cfg.jnp_dtype)  # the unquantized run's compacted cache
    assert out.cache_bytes < 0.3 * dense.nbytes()


def test_chunked_prefill_quantizes_the_chunked_selection(bundled, monkeypatch):
    """Chunked prefill, then int4: a prompt in one chunk stores the one-shot prefill's codes; in 32-token
    chunks (evicting after each) the kept entries are those of the unquantized chunked compression and the
    codes are the quantization of its kept keys and values."""
    config = kv_quant.PRESETS["int4"]
    prompts = _prompts(bundled)
    cap = _Capture(monkeypatch)
    _run(bundled, prompts, "snapkv", budget=48, kv_quant="int4")
    _run(bundled, prompts, "snapkv", budget=48, kv_quant="int4", prefill_chunk=128)
    quant = _run(bundled, prompts, "snapkv", budget=48, kv_quant="int4", prefill_chunk=32)
    one_shot, one_chunk, chunked = cap.quantized
    assert _kept(one_shot) == _kept(one_chunk)
    for field in ("k", "v"):
        a, b = getattr(one_shot, field), getattr(one_chunk, field)
        assert _by_position_equal(one_shot, a.codes, one_chunk, b.codes), field
        assert _by_position_equal(one_shot, a.scale, one_chunk, b.scale), field
    dense = jax.device_get(kvjax.engine.compress(bundled, prompts, policy="snapkv", budget=48, prefill_chunk=32))
    assert _kept(chunked) == _kept(dense) != _kept(one_shot)  # chunking changed the selection, quantizing did not
    ref = jax.device_get(cache_quant.from_cache(dense, config, cap.rooms[-1]))
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(quant.kept, 48)


def test_data_model_mesh_gives_the_single_device_tokens(bundled, monkeypatch):
    """Rows over "data", KV heads over "model" (2 x 2 of the fake CPU devices): quantized storage decodes
    the single-device tokens, prefill-only (snapkv, int4) and decode-time (h2o, int2), keeps the same
    entries, stores them alike, and its codes are laid out over the mesh."""
    prompts = _prompts(bundled)
    mesh = kvjax.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    sharded = kvjax.load_model("bundled", mesh=mesh)
    cap = _Capture(monkeypatch)
    for name, fmt, kw in (("snapkv", "int4", {}), ("h2o", "int2", dict(budget=DECODE_BUDGET))):
        single = _run(bundled, prompts, name, kv_quant=fmt, **kw)
        out = _run(sharded, prompts, name, kv_quant=fmt, **kw)
        np.testing.assert_array_equal(out.tokens, single.tokens, err_msg=name)
        np.testing.assert_array_equal(out.kept_final, single.kept_final, err_msg=name)
        sharding = cap.shardings[-1]
        assert len(sharding.device_set) == 4 and tuple(sharding.spec)[1:3] == ("data", "model"), sharding
        a, b = cap.quantized[-2], cap.quantized[-1]
        assert _kept(a) == _kept(b) and _kept(cap.end[-2]) == _kept(cap.end[-1])
        cfg = kv_quant.PRESETS[fmt]
        for qa, qb in ((a.k, b.k), (a.v, b.v)):  # the same codes, up to a last-bit rounding of the sharded sums
            ca, cb = np.asarray(kv_quant.codes_of(qa, cfg)), np.asarray(kv_quant.codes_of(qb, cfg))
            assert np.abs(ca.astype(int) - cb.astype(int)).max() <= 1 and (ca != cb).mean() < 1e-3
            np.testing.assert_allclose(np.asarray(qa.scale, np.float32), np.asarray(qb.scale, np.float32), rtol=1e-3)


# ----------------------------------------------------------------------------- Gemma, LookaheadKV, protocols


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    from tiny_models import build_hf

    folder = tmp_path_factory.mktemp("gemma3_quant")
    build_hf("gemma3", folder)
    return folder


def _gemma_prompts(cfg):
    return [np.random.RandomState(3).randint(3, cfg.vocab_size, n).tolist() for n in LENGTHS]


def test_gemma_quantizes_the_global_layers_and_keeps_the_rolling_buffers(gemma_folder, monkeypatch):
    """Gemma 3 (2 global layers of 5; the others slide over rolling buffers of 8): int8 quantizes the
    global layers' kept entries, the kept entries being those of the unquantized compression; the local
    buffers stay in the model dtype, exactly as the unquantized prefill left them."""
    model = kvjax.load_model(gemma_folder)
    cfg = model.config
    prompts = _gemma_prompts(cfg)
    dense = jax.device_get(kvjax.engine.compress(model, prompts, policy="snapkv", compression_ratio=RATIO))
    cap = _Capture(monkeypatch)
    out = _run(model, prompts, "snapkv", kv_quant="int8")
    qc = cap.quantized[0]
    assert qc.pos.shape[0] == cfg.num_global_layers == 2 < cfg.num_layers
    assert qc.k.codes.dtype == np.int8 and qc.v.codes.dtype == np.int8 and qc.k.codes.shape[0] == 2
    assert _kept(qc) == _kept(dense)
    np.testing.assert_array_equal(qc.flushed, np.asarray(qc.valid).sum(-1))  # every kept global entry quantized
    assert isinstance(qc.local, KVCache) and qc.local.k.dtype == cfg.jnp_dtype == jnp.float32
    assert qc.local.k.shape[0] == cfg.num_layers - cfg.num_global_layers and qc.local.k.shape[3] == 8
    for a, b in zip(jax.tree.leaves(qc.local), jax.tree.leaves(dense.local)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(out.kept, [50, 35])
    assert out.cache_layout == "quantized" and out.tokens.shape == (2, MAX_NEW)


@pytest.mark.slow
def test_gemma_sixteen_bit_storage_gives_the_unquantized_tokens(gemma_folder, monkeypatch):
    """bf16 storage of the bfloat16 Gemma 3: the unquantized tokens, prefill-only and decode-time, the
    rolling buffers left in bfloat16."""
    model = kvjax.load_model(gemma_folder, dtype="bfloat16")
    prompts = _gemma_prompts(model.config)
    cap = _Capture(monkeypatch)
    for name in ("snapkv", "h2o"):
        a = _run(model, prompts, name)
        b = _run(model, prompts, name, kv_quant="bf16")
        np.testing.assert_array_equal(b.tokens, a.tokens, err_msg=name)
        np.testing.assert_array_equal(b.kept_final, a.kept_final, err_msg=name)
        assert cap.quantized[-1].local.k.dtype == jnp.bfloat16


def test_lookahead_kv_with_its_adapter(bundled, monkeypatch):
    """LookaheadKV with the bundled model's adapter (its learned tokens' pass runs after the prefill, on the
    full-precision cache): the int8 run keeps the unquantized compression's entries and stores exactly
    their codes; the lookahead tokens leave nothing in the quantized cache."""
    policy = policies.get("lookahead_kv")
    assert policy.lookahead_adapter() is not None
    prompts = _prompts(bundled)
    dense = jax.device_get(kvjax.engine.compress(bundled, prompts, policy=policy, budget=40))
    cap = _Capture(monkeypatch)
    quant = kvjax.generate(bundled, prompts, policy=policy, budget=40, max_new_tokens=MAX_NEW, stop_tokens=[],
                           kv_quant="int8")
    qc = cap.quantized[0]
    assert _kept(qc) == _kept(dense)
    ref = jax.device_get(cache_quant.from_cache(dense, kv_quant.PRESETS["int8"], cap.rooms[0]))
    for a, b in zip(jax.tree.leaves(qc), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(a, b)
    pos = np.asarray(qc.pos)[np.asarray(qc.valid)]
    assert pos.max() < max(LENGTHS) and (np.asarray(qc.valid).sum(-1) == 40).all()  # prompt entries only
    np.testing.assert_allclose(quant.kept, 40)


@pytest.mark.parametrize("protocol, name", [("question_agnostic", "snapkv"), ("query_aware", "snapkv"),
                                            pytest.param("question_agnostic", "h2o", marks=pytest.mark.slow),
                                            pytest.param("query_aware", "h2o", marks=pytest.mark.slow)])
def test_question_protocols(bundled16, monkeypatch, protocol, name):
    """Context then question (`questions=`): question-agnostic compresses the context alone and feeds the
    question; query-aware compresses context + question and feeds the answer prefix (kvjax.eval's two
    protocols). Either way the fed tokens are written in full precision and then quantized with the kept
    context (every entry of the cache becomes codes), the kept context entries are the unquantized run's, and
    bf16 storage gives the unquantized tokens (snapkv; H2O, whose first decode step evicts back to its budget
    after the fed tokens)."""
    rng = np.random.RandomState(5)
    vocab = bundled16.config.vocab_size
    contexts = _prompts(bundled16, (90, 70))
    questions = [rng.randint(3, vocab, n).tolist() for n in (10, 7)]
    if protocol == "query_aware":
        contexts = [c + q for c, q in zip(contexts, questions)]
        questions = [rng.randint(3, vocab, n).tolist() for n in (3, 2)]  # the answer prefixes
    cap = _Capture(monkeypatch)
    full = _run(bundled16, contexts, name, questions=questions)
    quant = _run(bundled16, contexts, name, questions=questions, kv_quant="bf16")
    np.testing.assert_array_equal(quant.tokens, full.tokens)
    dense, qc = cap.start[0], cap.quantized[0]
    assert _kept(qc) == _kept(dense)
    pos, valid = np.asarray(qc.pos), np.asarray(qc.valid)
    if qc.reuses_slots:  # H2O: decode appends take freed slots; no entry starts in the window
        coded = valid & ~np.asarray(qc.windowed)
    else:
        coded = valid & (np.arange(qc.capacity) < np.asarray(qc.flushed)[..., None])
    np.testing.assert_array_equal(coded, valid)  # every entry quantized, the fed ones included
    for b, (c, n) in enumerate(zip(contexts, questions)):
        for t in range(len(c), len(c) + len(n)):  # each fed token is in every head of every layer
            assert ((pos[:, b] == t) & valid[:, b]).any(-1).all(), (b, t)
    np.testing.assert_allclose(quant.kept, valid.sum(-1).mean(axis=(0, 2)) - [len(n) for n in questions])
