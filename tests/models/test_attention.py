"""Attention building blocks against a NumPy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import kernels
from kvjax.kernels import _common
from kvjax.kernels.column_mass.reference import log_sum_exp
from kvjax.models import attention, llama
from kvjax.models.attention import flash_attention


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
    out, probs = llama.attend(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(q_pos),
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
    out, probs = llama.attend(q, k, v, jnp.asarray(pos), jnp.asarray(k_pos), 0.3)
    blocked, mass = llama.attend_blocked(q, k, v, jnp.asarray(pos), jnp.asarray(k_pos), 0.3, 16, column_mass=True)
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
    want, _ = llama.attend(q, k, v, q_pos, k_pos, 0.4)
    got, lse = jax.jit(functools.partial(flash_attention, scale=0.4, block_q=blocks[0], block_k=blocks[1]))(
        q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(log_sum_exp(q, k, q_pos, k_pos, scale=0.4)), atol=2e-6)
    blind = np.asarray(jnp.all((k_pos[:, :, None, :] < 0) | (k_pos[:, :, None, :] > q_pos[:, None, :, None]), -1))
    assert np.asarray(got)[np.repeat(blind, Hq // Hkv, axis=1)].max(initial=0) == 0


@pytest.mark.parametrize("window, softcap", [(7, None), (None, 2.0), (20, 3.0)])
def test_flash_attention_window_and_softcap(window, softcap):
    rng = np.random.RandomState(3)
    B, Hq, Hkv, n, D = 2, 4, 2, 70, 8
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, "left", B, Hkv, n, n))
    want, _ = llama.attend(q, k, v, q_pos, k_pos, 0.4, window=window, softcap=softcap)
    got, _ = flash_attention(q, k, v, q_pos, k_pos, 0.4, window=window, softcap=softcap, block_q=16, block_k=8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


def test_flash_attention_bfloat16_close_to_attend():
    rng = np.random.RandomState(4)
    B, Hq, Hkv, n, D = 1, 4, 2, 64, 16
    q, k, v = (jnp.asarray(rng.randn(*s), jnp.bfloat16) for s in ((B, Hq, n, D), (B, Hkv, n, D), (B, Hkv, n, D)))
    q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in _layout(rng, "right", B, Hkv, n, n))
    want, _ = llama.attend(q, k, v, q_pos, k_pos, 0.25)
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
    assert bool(attention.index_causal(q_pos))
    want, _ = llama.attend(q, k, v, q_pos, k_pos, 0.125, window=window, softcap=softcap)
    got, lse = attention.splash_attention(q, k, v, q_pos, 0.125, window=window, softcap=softcap, interpret=True)
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
    assert not bool(attention.index_causal(q_pos))
    got, _ = attention.prefill_attention(q, k, v, q_pos, k_pos, 0.3, own_keys=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(llama.attend(q, k, v, q_pos, k_pos, 0.3)[0]), atol=2e-6)


@pytest.mark.parametrize("n, D, dtype", [(8192, 128, jnp.bfloat16), (4096, 64, jnp.float32)])
def test_prefill_attention_lowers_to_splash_for_tpu(monkeypatch, n, D, dtype):
    """On TPU a prefill's attention is jax's splash kernel (Mosaic), Llama-3-8B-like and bench shapes."""
    monkeypatch.delenv(_common.ENV_VAR, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    Hq, Hkv = (32, 8) if D == 128 else (8, 2)
    SD = jax.ShapeDtypeStruct
    args = (SD((1, Hq, n, D), dtype), SD((1, Hkv, n, D), dtype), SD((1, Hkv, n, D), dtype), SD((1, n), jnp.int32),
            SD((1, Hkv, n), jnp.int32))
    fn = functools.partial(attention.prefill_attention, scale=D ** -0.5, own_keys=True)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 1
