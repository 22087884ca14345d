"""The attention op (kvjax.kernels.attention): every implementation against a NumPy reference, the
fallback between them, and the TPU lowering of the splash path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import kernels
from kvjax.kernels import _common
from kvjax.kernels.attention import Keys, SegmentedKeys, api, attention, cudnn_gpu, splash_tpu
from kvjax.kernels.attention.flash_xla import flash_attention
from kvjax.kernels.attention.reference import attend, attend_blocked
from kvjax.kernels.column_mass.reference import log_sum_exp


def _numpy_attention(q, k, v, q_pos, k_pos, scale):
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            for i in range(n):
                vis = (k_pos[b, h // G] >= 0) & (k_pos[b, h // G] <= q_pos[b, i])
                if not vis.any():
                    continue
                s = k[b, h // G][vis] @ q[b, h, i] * scale
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ v[b, h // G][vis]
    return out


def test_attend_equals_numpy_with_gqa_padding_and_empty_rows():
    rng = np.random.RandomState(0)
    B, Hq, Hkv, n, S, D = 2, 8, 2, 5, 9, 4
    q, k, v = rng.randn(B, Hq, n, D), rng.randn(B, Hkv, S, D), rng.randn(B, Hkv, S, D)
    k_pos = rng.randint(-1, 7, (B, Hkv, S))
    q_pos = np.array([[0, 3, 6, -1, 2], [-1, -1, 5, 1, 4]])
    out, probs = attend(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(q_pos),
                              jnp.asarray(k_pos), 0.5)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v, q_pos, k_pos, 0.5), atol=1e-5)
    assert np.isfinite(np.asarray(probs)).all()
    np.testing.assert_array_equal(np.asarray(out)[0, :, 3], 0.0)  # padding query: fully masked row -> zeros


def test_blocked_attention_equals_unblocked_and_column_mass():
    rng = np.random.RandomState(1)
    B, Hq, Hkv, n, D = 2, 4, 2, 64, 8
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    lengths = np.array([64, 37])
    pos = np.where(np.arange(n) < lengths[:, None], np.arange(n), -1)
    k_pos = np.broadcast_to(pos[:, None], (B, Hkv, n))
    out, probs = attend(q, k, v, jnp.asarray(pos), jnp.asarray(k_pos), 0.3)
    blocked, mass = attend_blocked(q, k, v, jnp.asarray(pos), jnp.asarray(k_pos), 0.3, 16, column_mass=True)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(out), atol=1e-6)
    p = np.asarray(probs)  # [B,Hkv,G,n,S]
    want = np.where((pos >= 0)[:, None, None, :, None], p, 0).sum(axis=(2, 3))
    np.testing.assert_allclose(np.asarray(mass), want, atol=1e-5)
    # every valid query distributes mass 1 per query head
    np.testing.assert_allclose(np.asarray(mass).sum(-1), lengths[:, None] * (Hq // Hkv) * np.ones((B, Hkv)), rtol=1e-5)


def test_masked_softmax_fully_masked_row_is_zero_not_nan():
    logits = jnp.array([[1.0, 2.0, 3.0], [jnp.nan, 5.0, 1.0]])
    mask = jnp.array([[False, False, False], [False, True, True]])
    p = np.asarray(kernels.masked_softmax(logits, mask))
    np.testing.assert_array_equal(p[0], 0.0)
    np.testing.assert_allclose(p[1], [0.0, 1 / (1 + np.exp(-4)), np.exp(-4) / (1 + np.exp(-4))], rtol=1e-6)


def _layout(rng, kind, B, Hkv, n, S):
    """(q_pos [B,n], k_pos [B,Hkv,S]) of a prefill (right or left padding), arbitrary positions, or new
    queries against a cache of scattered slots."""
    ar = np.arange(n)
    if kind == "right":
        lengths = rng.randint(1, n + 1, B)
        q_pos = np.where(ar < lengths[:, None], ar, -1)
    elif kind == "left":
        off = n - rng.randint(1, n + 1, B)
        q_pos = np.where(ar >= off[:, None], ar - off[:, None], -1)
    elif kind == "holes":  # padding inside the row as well
        q_pos = np.where(rng.rand(B, n) < 0.2, -1, ar)
    elif kind == "random":
        return rng.randint(-1, 3 * n // 4, (B, n)), rng.randint(-1, 3 * n // 4, (B, Hkv, S))
    else:  # "cache": n new queries after S scattered, partly empty slots
        return np.broadcast_to(np.arange(S, S + n), (B, n)), np.where(rng.rand(B, Hkv, S) < 0.3, -1,
                                                                       rng.permutation(S)[None, None])
    return q_pos, np.broadcast_to(q_pos[:, None], (B, Hkv, n))


@pytest.mark.parametrize("kind", ["right", "left", "holes", "random", "cache"])
@pytest.mark.parametrize("blocks", [(16, 16), (8, 32), (32, 8), (512, 512)])
def test_flash_attention_equals_attend(kind, blocks):
    """Flash attention (blocks skipped and unmasked by position) equals the materialised `attend`, and
    its log-sum-exp the reference's; rows that see nothing give zeros."""
    rng = np.random.RandomState(hash((kind, blocks)) % 2**31)
    B, Hq, Hkv, n, D = 2, 8, 2, 75, 8
    S = n if kind not in ("cache", "random") else 90
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, kind, B, Hkv, n, S))
    want, _ = attend(q, k, v, q_pos, k_pos, 0.4)
    got, lse = jax.jit(functools.partial(flash_attention, scale=0.4, block_q=blocks[0], block_k=blocks[1]))(
        q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(log_sum_exp(q, k, q_pos, k_pos, scale=0.4)), atol=2e-6)
    blind = np.asarray(jnp.all((k_pos[:, :, None, :] < 0) | (k_pos[:, :, None, :] > q_pos[:, None, :, None]), -1))
    assert np.asarray(got)[np.repeat(blind, Hq // Hkv, axis=1)].max(initial=0) == 0


@pytest.mark.parametrize("kind", ["right", "left", "holes", "random", "cache"])
def test_flash_attention_row_by_row_equals_the_batch(kind):
    """`per_row` (each row its own block ranges) and the batched path give the same output and lse, both
    equal to `attend`, on rows of unequal lengths (a padded batch)."""
    rng = np.random.RandomState(hash(kind) % 2**31)
    B, Hq, Hkv, n, D = 3, 4, 2, 70, 8
    S = n if kind not in ("cache", "random") else 90
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    q_pos, k_pos = (np.array(x) for x in _layout(rng, kind, B, Hkv, n, S))
    if kind in ("right", "left"):  # rows of 70, 41 and 9 real tokens
        for b, m in ((1, 41), (2, 9)):
            row = np.full(n, -1)
            row[:m] = np.arange(m)
            q_pos[b] = row if kind == "right" else np.roll(row, n - m)
            k_pos[b] = q_pos[b][None]
    q_pos, k_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)
    want, _ = attend(q, k, v, q_pos, k_pos, 0.4)
    run = {flag: jax.jit(functools.partial(flash_attention, scale=0.4, block_q=16, block_k=8, per_row=flag))(
        q, k, v, q_pos, k_pos) for flag in (True, False)}
    np.testing.assert_allclose(np.asarray(run[True][0]), np.asarray(want), atol=2e-6)
    np.testing.assert_allclose(np.asarray(run[True][0]), np.asarray(run[False][0]), atol=2e-6)
    np.testing.assert_allclose(np.asarray(run[True][1]), np.asarray(run[False][1]), atol=2e-6)


@pytest.mark.parametrize("window, softcap", [(7, None), (None, 2.0), (20, 3.0)])
def test_flash_attention_window_and_softcap(window, softcap):
    rng = np.random.RandomState(3)
    B, Hq, Hkv, n, D = 2, 4, 2, 70, 8
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, "left", B, Hkv, n, n))
    want, _ = attend(q, k, v, q_pos, k_pos, 0.4, window=window, softcap=softcap)
    got, _ = flash_attention(q, k, v, q_pos, k_pos, 0.4, window=window, softcap=softcap, block_q=16, block_k=8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


def test_flash_attention_bfloat16_close_to_attend():
    rng = np.random.RandomState(4)
    B, Hq, Hkv, n, D = 1, 4, 2, 64, 16
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.bfloat16) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, "right", B, Hkv, n, n))
    want, _ = attend(q, k, v, q_pos, k_pos, 0.25)
    got, _ = flash_attention(q, k, v, q_pos, k_pos, 0.25, block_q=16, block_k=16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2)


@pytest.mark.parametrize("kind", ["right", "left", "holes", "random", "cache"])
def test_key_block_ranges_skip_only_invisible_blocks(kind):
    """Blocks outside [start, end) hold no visible pair; `full` blocks hold only visible pairs; a
    prefill's causal upper triangle is outside the range."""
    rng = np.random.RandomState(5)
    B, Hkv, n, bq, bk = 2, 2, 64, 16, 8
    S = 64 if kind not in ("cache", "random") else 96
    q_pos, k_pos = _layout(rng, kind, B, Hkv, n, S)
    for window in (None, 10):
        start, end, full = (np.asarray(x) for x in _common.key_block_ranges(
            jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32), bq, bk, window))
        vis = (k_pos[:, :, None, :] >= 0) & (k_pos[:, :, None, :] <= q_pos[:, None, :, None])
        if window is not None:
            vis &= k_pos[:, :, None, :] > q_pos[:, None, :, None] - window
        blocks = vis.reshape(B, Hkv, n // bq, bq, S // bk, bk)
        some, every = blocks.any(axis=(0, 1, 3, 5)), blocks.all(axis=(0, 1, 3, 5))
        for i in range(n // bq):
            inside = (np.arange(S // bk) >= start[i]) & (np.arange(S // bk) < end[i])
            assert not some[i][~inside].any()
            assert not full[i][~every[i]].any()
        if kind == "right" and window is None:
            assert (end <= (np.arange(n // bq) + 1) * bq // bk).all()  # no block past the diagonal


@pytest.mark.parametrize("kind, window, softcap", [("right", None, None), ("left", None, None), ("holes", 50, 2.0)])
def test_splash_attention_interpreted_equals_attend(kind, window, softcap):
    """jax's splash attention (TPU path, here in the Pallas interpreter) gives attend's outputs and the
    log-sum-exp of a prefill's real queries, zeros for padding ones."""
    rng = np.random.RandomState(6)
    B, Hq, Hkv, n, D = 2, 4, 2, 256, 64
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, kind, B, Hkv, n, n))
    assert bool(splash_tpu.index_causal(q_pos))
    want, _ = attend(q, k, v, q_pos, k_pos, 0.125, window=window, softcap=softcap)
    got, lse = splash_tpu.splash_attention(q, k, v, q_pos, 0.125, window=window, softcap=softcap, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    if window is None and softcap is None:
        np.testing.assert_allclose(np.asarray(lse), np.asarray(log_sum_exp(q, k, q_pos, k_pos, scale=0.125)), atol=2e-6)


def test_prefill_attention_falls_back_when_positions_are_not_index_causal(monkeypatch):
    """With splash selected, rows whose positions do not increase along the index take flash_attention."""
    monkeypatch.setenv(_common.ENV_VAR, "interpret")
    rng = np.random.RandomState(7)
    B, Hq, Hkv, n, D = 1, 4, 2, 128, 16
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos = jnp.asarray(rng.permutation(n)[None], jnp.int32)
    k_pos = jnp.broadcast_to(q_pos[:, None], (B, Hkv, n))
    assert not bool(splash_tpu.index_causal(q_pos))
    got = attention(q, Keys(k, v, k_pos), q_pos, scale=0.3, own_keys=True, implementation=("splash",)).out
    np.testing.assert_allclose(np.asarray(got), np.asarray(attend(q, k, v, q_pos, k_pos, 0.3)[0]), atol=2e-6)


@pytest.mark.parametrize("n, D, dtype", [(8192, 128, jnp.bfloat16), (4096, 64, jnp.float32)])
def test_prefill_attention_lowers_to_splash_for_tpu(monkeypatch, n, D, dtype):
    """On TPU a prefill's attention is jax's splash kernel (Mosaic), Llama-3-8B-like and bench shapes."""
    monkeypatch.delenv(_common.ENV_VAR, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    Hq, Hkv = (32, 8) if D == 128 else (8, 2)
    SD = jax.ShapeDtypeStruct
    args = (SD((1, Hq, n, D), dtype), SD((1, Hkv, n, D), dtype), SD((1, Hkv, n, D), dtype), SD((1, n), jnp.int32),
            SD((1, Hkv, n), jnp.int32))

    def fn(q, k, v, q_pos, k_pos):  # the default order on TPU: splash takes a prefill's own keys
        return attention(q, Keys(k, v, k_pos), q_pos, scale=D ** -0.5, returns=("lse",), own_keys=True)

    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 1


# ---------------------------------------------------------------------------------------------- the op's table


def _inputs(rng, n, S, kind, B=2, Hq=8, Hkv=2, D=8):
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, kind, B, Hkv, n, S))
    return q, k, v, q_pos, k_pos


def _numpy_probs(q, k, q_pos, k_pos, scale):
    """[B,Hkv,G,n,S] probabilities of the NumPy reference (zero rows where nothing is seen)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    logits = np.einsum("bhgnd,bhsd->bhgns", q.reshape(B, Hkv, Hq // Hkv, n, D), k) * scale
    vis = (k_pos[:, :, None, None, :] >= 0) & (k_pos[:, :, None, None, :] <= q_pos[:, None, None, :, None])
    m = np.where(vis, logits, -np.inf).max(-1, keepdims=True, initial=-1e30)
    e = np.exp(np.where(vis, logits - m, -np.inf))
    return e / np.maximum(e.sum(-1, keepdims=True), 1e-300)


@pytest.mark.parametrize("name, n, S, kind, own, returns", [
    ("materialized", 9, 9, "right", True, ("probs", "column_mass")),
    ("materialized", 6, 20, "cache", False, ("probs",)),
    ("flash", 40, 40, "left", True, ("lse", "column_mass")),
    ("flash", 7, 30, "cache", False, ("lse",)),
    ("decode", 1, 30, "cache", False, ("probs", "column_mass")),
    ("blocked", 2048, 2048, "right", True, ("column_mass",)),
    ("xla_fused", 24, 24, "right", True, ()),
])
def test_each_implementation_equals_numpy(name, n, S, kind, own, returns):
    """Every implementation of the attention op, asked by name, gives the NumPy reference's output and what
    the caller asked back (log-sum-exp, probabilities, column mass: the op derives the ones it lacks)."""
    rng = np.random.RandomState(11)
    Hq = 8 if n < 1024 else 2
    q, k, v, q_pos, k_pos = _inputs(rng, n, S, kind, B=1 if n >= 1024 else 2, Hq=Hq, Hkv=2 if Hq == 8 else 1)
    if name == "xla_fused":  # its contract: right-padded rows attending to their own tokens
        q_pos = jnp.asarray(np.where(np.arange(n) < np.array([[n], [n - 5]]), np.arange(n), -1), jnp.int32)
        k_pos = jnp.broadcast_to(q_pos[:, None], k.shape[:3])
    res = attention(q, Keys(k, v, k_pos), q_pos, scale=0.3, returns=returns, own_keys=own,
                    index_causal=name == "xla_fused", implementation=name)
    p = _numpy_probs(q, k, np.asarray(q_pos), np.asarray(k_pos), 0.3)
    B, Hkv, G = p.shape[:3]
    want = np.einsum("bhgns,bhsd->bhgnd", p, np.asarray(v, np.float64)).reshape(q.shape)
    real = np.asarray(q_pos >= 0)[:, None, :, None]
    np.testing.assert_allclose(np.where(real, res.out, 0), np.where(real, want, 0), atol=3e-5)
    if "probs" in returns:
        np.testing.assert_allclose(np.asarray(res.probs), p, atol=2e-6)
    if "lse" in returns:
        np.testing.assert_allclose(np.asarray(res.lse), np.asarray(log_sum_exp(q, k, q_pos, k_pos, scale=0.3)), atol=3e-5)
    if "column_mass" in returns:
        np.testing.assert_allclose(np.asarray(res.column_mass), p.sum(axis=(2, 3)), atol=2e-4, rtol=1e-4)


def test_segment_implementation_equals_dense_decode():
    """The ragged layout's segments (each head's slots contiguous in one row buffer) attend as the same
    entries held per head do, soft-capped or not."""
    rng = np.random.RandomState(12)
    B, Hq, Hkv, S, D = 2, 4, 2, 10, 8
    q, k, v, q_pos, k_pos = _inputs(rng, 1, S, "cache", B, Hq, Hkv, D)
    k_pos = k_pos.at[:, :, -2:].set(-1)  # free slots at each head's end
    seg = jnp.broadcast_to(jnp.repeat(jnp.arange(Hkv), S)[None], (B, Hkv * S))
    flat = SegmentedKeys(k=k.reshape(B, Hkv * S, D), v=v.reshape(B, Hkv * S, D), pos=k_pos.reshape(B, Hkv * S),
                         seg=seg, num_kv_heads=Hkv)
    for cap in (None, 1.5):
        got = attention(q, flat, q_pos, scale=0.4, softcap=cap, implementation="segment").out
        want = attention(q, Keys(k, v, k_pos), q_pos, scale=0.4, softcap=cap, implementation="materialized").out
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


def test_fallback_order_and_refusals(monkeypatch):
    """The first implementation of the order that accepts runs (a decode step: `decode`; the same step with
    probabilities and a soft-cap: `materialized`); names come from the env variable or the argument;
    nothing accepting gives a NotImplementedError that lists every refusal; bad names and returns are named."""
    rng = np.random.RandomState(13)
    q, k, v, q_pos, k_pos = _inputs(rng, 1, 16, "cache")
    keys = Keys(k, v, k_pos)
    calls = []
    for name in ("decode", "materialized"):
        real, backends = api.IMPLEMENTATIONS[name]
        monkeypatch.setitem(api.IMPLEMENTATIONS, name,
                            (lambda *a, real=real, name=name: (calls.append(name), real(*a))[1], backends))
    attention(q, keys, q_pos, scale=0.5, returns=("probs",))
    attention(q, keys, q_pos, scale=0.5, returns=("probs",), softcap=2.0)
    assert calls == ["decode", "decode", "materialized"]  # the soft-cap: decode declines, materialized runs
    monkeypatch.setenv(api.ENV_VAR, "flash, materialized")
    assert api.order() == ("flash", "materialized")
    with pytest.raises(NotImplementedError, match=r"flash \(flash takes more than one query.*segment \(segment reads"):
        attention(q, keys, q_pos, scale=0.5, implementation=("flash", "segment"))
    with pytest.raises(ValueError, match="names must come from"):
        attention(q, keys, q_pos, scale=0.5, implementation="flash3")
    with pytest.raises(ValueError, match="accepted values"):
        attention(q, keys, q_pos, scale=0.5, returns=("weights",))


def test_fully_masked_rows_never_give_nan():
    """A row that sees no key gives a zero output and zero probabilities in every implementation."""
    rng = np.random.RandomState(14)
    q, k, v, _, _ = _inputs(rng, 4, 12, "cache")
    q_pos = jnp.full((2, 4), -1, jnp.int32)
    k_pos = jnp.full((2, 2, 12), -1, jnp.int32)
    for name, returns in (("materialized", ("probs",)), ("flash", ("lse",))):
        res = attention(q, Keys(k * 1e4, v, k_pos), q_pos, scale=0.5, returns=returns, implementation=name)
        for x in (res.out, res.probs, res.lse):
            if x is not None:
                assert np.isfinite(np.asarray(x)).all() and not np.asarray(x).any()


# ---------------------------------------------------------------------------------------------- cuDNN (GPU)


@pytest.mark.parametrize("kind, want", [("right", True), ("left", False), ("holes", False), ("perm", False)])
def test_right_padded_index_causal(kind, want):
    """cuDNN masks by index and per-row length: only right-padded rows with increasing positions qualify."""
    rng = np.random.RandomState(15)
    if kind == "perm":
        q_pos = rng.permutation(12)[None]
    else:
        q_pos = _layout(rng, kind, 3, 1, 12, 12)[0]
        if kind == "left":
            q_pos[0, 0] = -1  # at least one row with padding in front
    assert bool(cudnn_gpu.right_padded_index_causal(jnp.asarray(q_pos, jnp.int32))) == want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cudnn_call_through_xla_equals_attend(dtype):
    """`fused_attention`'s call (layout, GQA, per-row lengths, padding zeroed) through XLA's implementation of
    the same jax API equals `attend` on right-padded rows: what the GPU runs differs only in the backend."""
    rng = np.random.RandomState(16)
    B, Hq, Hkv, n, D = 2, 8, 2, 48, 16
    q, k, v = (jnp.asarray(rng.randn(*s), dtype) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos = jnp.asarray(np.where(np.arange(n) < np.array([[n], [29]]), np.arange(n), -1), jnp.int32)
    k_pos = jnp.broadcast_to(q_pos[:, None], (B, Hkv, n))
    got = cudnn_gpu.fused_attention(q, k, v, q_pos, 0.25, implementation="xla")
    want, _ = attend(*(x.astype(jnp.float32) for x in (q, k, v)), q_pos, k_pos, 0.25)
    assert got.dtype == dtype and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), **({"atol": 2e-6} if dtype == jnp.float32
                                                                              else {"atol": 3e-2}))
    assert not np.asarray(got, np.float32)[1, :, 29:].any()  # padding queries: zeros


@pytest.mark.parametrize("kind, index_causal", [("right", False), ("left", False), ("right", True)])
def test_cudnn_implementation_in_the_op(monkeypatch, kind, index_causal):
    """Through the op: right-padded index-causal rows take the fused call, others the flash branch (a caller
    that says index_causal: the fused call alone); all equal the NumPy reference, and the column mass comes
    from the two-pass kernel (cuDNN gives no usable lse)."""
    used = []
    real_fused = cudnn_gpu.fused_attention

    def through_xla(q, k, v, q_pos, scale):
        used.append(True)
        return real_fused(q, k, v, q_pos, scale, implementation="xla")

    monkeypatch.setattr(cudnn_gpu, "fused_attention", through_xla)
    rng = np.random.RandomState(17)
    B, Hq, Hkv, n, D = 2, 4, 2, 40, 16
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.bfloat16) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, kind, B, Hkv, n, n))
    if kind == "left":
        q_pos = q_pos.at[0, 0].set(-1)
        k_pos = jnp.broadcast_to(q_pos[:, None], (B, Hkv, n))
    fused_taken = bool(cudnn_gpu.right_padded_index_causal(q_pos))
    assert fused_taken == (kind == "right")
    res = jax.jit(lambda q, k, v, qp, kp: attention(q, Keys(k, v, kp), qp, scale=0.3, returns=("column_mass",),
                                                    own_keys=True, index_causal=index_causal,
                                                    implementation="cudnn"))(q, k, v, q_pos, k_pos)
    assert used  # the fused branch was traced (lax.cond traces both)
    p = _numpy_probs(*(np.asarray(x, np.float64) for x in (q, k)), np.asarray(q_pos), np.asarray(k_pos), 0.3)
    want = np.einsum("bhgns,bhsd->bhgnd", p, np.asarray(v, np.float64)).reshape(q.shape)
    real = np.asarray(q_pos >= 0)[:, None, :, None]
    np.testing.assert_allclose(np.where(real, np.asarray(res.out, np.float32), 0), np.where(real, want, 0), atol=3e-2)
    np.testing.assert_allclose(np.asarray(res.column_mass), p.sum(axis=(2, 3)), atol=2e-4, rtol=1e-4)


def test_cudnn_declines_where_it_cannot_run():
    """float32 queries, a window, a decode step or a CPU without cuDNN: cudnn declines and the next
    implementation of the order runs; it comes first on GPUs only."""
    rng = np.random.RandomState(18)
    q, k, v, q_pos, k_pos = _inputs(rng, 16, 16, "right")
    keys = Keys(k, v, k_pos)
    with pytest.raises(NotImplementedError, match=r"cudnn \(cudnn takes bfloat16 or float16"):
        attention(q, keys, q_pos, scale=0.5, own_keys=True, implementation="cudnn")
    with pytest.raises(NotImplementedError, match=r"cudnn \(cudnn takes a prefill's own keys"):
        attention(q.astype(jnp.bfloat16), keys, q_pos, scale=0.5, own_keys=True, window=4, implementation="cudnn")
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError, match=r"cudnn \(cudnn refused"):
            attention(q.astype(jnp.bfloat16), keys, q_pos, scale=0.5, own_keys=True, implementation="cudnn")
    got = attention(q.astype(jnp.bfloat16), keys, q_pos, scale=0.5, own_keys=True, implementation=("cudnn", "flash"))
    want = attention(q.astype(jnp.bfloat16), keys, q_pos, scale=0.5, own_keys=True, implementation="flash")
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32))
    assert api.default_order("gpu")[:2] == ("cudnn", "xla_fused")
    assert "cudnn" not in api.default_order("cpu") and "cudnn" not in api.default_order("tpu")


@pytest.mark.gpu_only
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")
@pytest.mark.parametrize("n", [1000, 4096])
def test_cudnn_on_gpu_equals_flash(n):
    """On a GPU with cuDNN: a right-padded bf16 prefill through the default order (cudnn) equals flash_xla."""
    rng = np.random.RandomState(19)
    B, Hq, Hkv, D = 2, 8, 2, 64
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.bfloat16) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos = jnp.asarray(np.where(np.arange(n) < np.array([[n], [n - 77]]), np.arange(n), -1), jnp.int32)
    k_pos = jnp.broadcast_to(q_pos[:, None], (B, Hkv, n))
    got = attention(q, Keys(k, v, k_pos), q_pos, scale=D ** -0.5, own_keys=True, implementation="cudnn").out
    want = flash_attention(q, k, v, q_pos, k_pos, D ** -0.5)[0]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)
