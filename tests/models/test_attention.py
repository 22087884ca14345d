"""Attention building blocks against a NumPy reference."""

import jax.numpy as jnp
import numpy as np

from kvjax import kernels
from kvjax.models import llama


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
