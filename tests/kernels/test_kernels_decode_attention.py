"""decode_attention: every implementation against the NumPy oracle (kernel_oracles.decode_attention)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import kernel_oracles as oracle
from kernel_helpers import OUT_TOL, SWEEP, TOL, as_np, assert_close, gpu_only, tpu_only
from kvjax import kernels
from kvjax.kernels.decode_attention import pallas_gpu

SCALE = 0.3


def make_case(rng, b, hkv, g, s, d, dtype, p_valid=0.7):
    """A cache after some evictions: random valid slots; invalid K and V slots hold NaN."""
    query = rng.normal(size=(b, hkv * g, d)).astype(np.float32)
    keys = rng.normal(size=(b, hkv, s, d)).astype(np.float32)
    values = rng.normal(size=(b, hkv, s, d)).astype(np.float32)
    valid = rng.random((b, hkv, s)) < p_valid
    keys[~valid] = np.nan
    values[~valid] = np.nan
    return (jnp.asarray(query, dtype), jnp.asarray(keys, dtype), jnp.asarray(values, dtype),
            jnp.asarray(valid))


class DecodeAttentionBase:
    IMPL: str = "xla"

    def kernel(self):
        return functools.partial(kernels.decode_attention, implementation=self.IMPL)

    def call(self, *args):
        return jax.jit(functools.partial(self.kernel(), scale=SCALE))(*args)

    def check(self, args, dtype):
        out, probs = self.call(*args)
        want_out, want_probs = oracle.decode_attention(*(as_np(a) if a.dtype != jnp.bool_ else a for a in args),
                                                       SCALE)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype
        assert probs.dtype == jnp.float32
        assert_close(probs, want_probs, **TOL[dtype])
        assert_close(out, want_out, **OUT_TOL[dtype])
        return as_np(out), as_np(probs)

    def test_matches_oracle_gqa_ragged(self):
        rng = np.random.default_rng(0)
        # G = 3 (not a power of two); S = 640 spans five key blocks of 128 on the TPU path.
        q, k, v, valid = make_case(rng, 2, 2, 3, 640, 32, jnp.float32)
        valid = valid.at[0, 1, :260].set(False).at[0, 1, 300:].set(False)  # leading/trailing empty blocks
        valid = valid.at[1, 0, 100:540].set(False)  # empty blocks in the middle
        _, probs = self.check((q, k, v, valid), jnp.float32)
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
        assert np.all(probs[~np.asarray(valid)[:, :, None, :].repeat(3, 2)] == 0.0)

    def test_fully_masked_row_gives_zeros(self):
        rng = np.random.default_rng(1)
        q, k, v, valid = make_case(rng, 2, 2, 2, 256, 16, jnp.float32)
        valid = valid.at[1, 0].set(False)
        out, probs = self.check((q, k, v, valid), jnp.float32)
        assert np.all(out[1, 0:2] == 0.0) and np.all(probs[1, 0] == 0.0)

    def test_bfloat16_inputs(self):
        rng = np.random.default_rng(2)
        self.check(make_case(rng, 1, 2, 4, 512, 64, jnp.bfloat16), jnp.bfloat16)

    @SWEEP
    @given(st.data())
    def test_shape_sweep(self, data):
        b = data.draw(st.integers(1, 3))
        hkv = data.draw(st.integers(1, 2))
        g = data.draw(st.sampled_from([1, 2, 4, 7]))
        s = data.draw(st.integers(1, 300))
        p_valid = data.draw(st.sampled_from([0.0, 0.3, 1.0]))
        rng = np.random.default_rng(s)
        self.check(make_case(rng, b, hkv, g, s, 16, jnp.float32, p_valid), jnp.float32)


class TestDecodeAttentionXla(DecodeAttentionBase):
    IMPL = "xla"


class TestDecodeAttentionInterpret(DecodeAttentionBase):
    """The Pallas TPU kernel in interpret mode (NaN-poisoned scratch), on CPU."""

    IMPL = "interpret"


class TestDecodeAttentionTritonInterpret(DecodeAttentionBase):
    """The Pallas Triton kernel run by the generic Pallas interpreter on CPU (logic only)."""

    def kernel(self):
        return functools.partial(pallas_gpu.decode_attention, interpret=True)

    def test_uneven_split_ranges_and_a_partial_last_block(self):
        # 13 blocks of 64 (a prime count; the last one 37 slots: the cache is not padded) over 4 programs per
        # head: ranges of 4, 4, 4 and 1 blocks
        rng = np.random.default_rng(3)
        s = 12 * 64 + 37
        q, k, v, valid = make_case(rng, 1, 2, 2, s, 32, jnp.float32)
        assert pallas_gpu._plan(s, 2, 64, 8) == (64, 13, 4, 4)
        out, probs = jax.jit(functools.partial(pallas_gpu.decode_attention, interpret=True, scale=SCALE,
                                               target_programs=8))(q, k, v, valid)
        want_out, want_probs = oracle.decode_attention(as_np(q), as_np(k), as_np(v), valid, SCALE)
        assert_close(probs, want_probs, **TOL[jnp.float32])
        assert_close(out, want_out, **OUT_TOL[jnp.float32])


def test_gpu_plan_fills_the_gpu_whatever_the_capacity():
    """A capacity of 16,448 slots (16K kept + 64 decode room: 257 blocks of 64, a prime) once ran as one
    program per KV head (8 on an H200: decode 2x slower than over the full 32K cache), and a capacity that
    is not a multiple of 16 ran in blocks of 16 over a padded copy of the cache. Every capacity now gets
    blocks of 64 and about target_programs programs, and the ranges cover each block exactly once."""
    for s in (16448, 16421, 32832, 8256, 4160, 13 * 64, 100, 17, 1):
        bk, blocks, bps, splits = pallas_gpu._plan(s, 8, 64, 256)
        assert bk == min(64, max(16, pallas_gpu.pow2_at_least(s))) and bk * (blocks - 1) < s <= bk * blocks
        assert (splits - 1) * bps < blocks <= splits * bps  # no empty program, every block in one range
        assert 8 * splits >= min(256, 8 * blocks) // 2


class TestDecodeAttentionTpu(DecodeAttentionBase):
    IMPL = "pallas_tpu"
    pytestmark = tpu_only


class TestDecodeAttentionGpu(DecodeAttentionBase):
    IMPL = "pallas_gpu"
    pytestmark = gpu_only
