"""column_mass: every implementation against the NumPy oracle (kernel_oracles.column_mass)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kernel_oracles as oracle
from kernel_helpers import SWEEP, TOL, as_np, assert_close, gpu_only, tpu_only
from kvjax import kernels
from kvjax.kernels.column_mass import pallas_gpu


def make_case(rng, b, hkv, g, t, d, lengths, dtype, s=None):
    """Prefill layout: row b's prompt is queries 0..len-1 and slots 0..len-1 (right padding)."""
    s = s or t
    lengths = np.asarray(lengths)
    q = rng.normal(size=(b, hkv * g, t, d)).astype(np.float32)
    k = rng.normal(size=(b, hkv, s, d)).astype(np.float32)
    qpos = np.where(np.arange(t)[None] < lengths[:, None], np.arange(t)[None], -1).astype(np.int32)
    kpos = oracle.right_padded_positions(lengths, hkv, s)
    q, k = oracle.poison_queries(q, qpos), oracle.poison_keys(k, kpos)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(qpos), jnp.asarray(kpos)


SCALE = 0.2


class ColumnMassBase:
    IMPL: str = "xla"

    def kernel(self):
        return functools.partial(kernels.column_mass, implementation=self.IMPL)

    def call(self, q, k, qpos, kpos, lse=None):
        fn = self.kernel()
        return jax.jit(lambda q, k, qp, kp, l: fn(q, k, qp, kp, scale=SCALE, lse=l))(q, k, qpos, kpos, lse)

    @pytest.mark.parametrize("given_lse", [False, True], ids=["lse_pass", "lse_given"])
    def test_matches_oracle_gqa_ragged(self, given_lse):
        rng = np.random.default_rng(0)
        # T = S = 640: several query and key blocks, with causal block skipping.
        q, k, qpos, kpos = make_case(rng, 2, 2, 2, 640, 32, [640, 300], jnp.float32)
        lse = None
        if given_lse:
            lse = jnp.asarray(oracle.log_sum_exp(as_np(q), as_np(k), qpos, kpos, SCALE), jnp.float32)
            lse = jnp.where(qpos[:, None, :] >= 0, lse, jnp.nan)  # padding queries' lse is junk
        got = self.call(q, k, qpos, kpos, lse)
        want = oracle.column_mass(as_np(q), as_np(k), qpos, kpos, SCALE)
        assert got.shape == (2, 2, 640) and got.dtype == jnp.float32
        assert_close(got, want, **TOL[jnp.float32])
        # Each valid query of each of the G heads spreads mass 1 over its keys.
        np.testing.assert_allclose(as_np(got).sum(-1), [[1280, 1280], [600, 600]], rtol=1e-5)

    def test_bfloat16_inputs(self):
        rng = np.random.default_rng(1)
        q, k, qpos, kpos = make_case(rng, 1, 2, 2, 256, 64, [230], jnp.bfloat16)
        got = self.call(q, k, qpos, kpos)
        want = oracle.column_mass(as_np(q), as_np(k), qpos, kpos, SCALE)
        assert got.dtype == jnp.float32
        assert_close(got, want, **TOL[jnp.bfloat16])

    def test_empty_head_gives_zeros(self):
        rng = np.random.default_rng(2)
        q, k, qpos, kpos = make_case(rng, 1, 2, 1, 64, 16, [50], jnp.float32)
        kpos = kpos.at[0, 0].set(-1)
        k = k.at[0, 0].set(jnp.nan)
        got = as_np(self.call(q, k, qpos, kpos))
        assert np.all(got[0, 0] == 0.0)
        assert_close(got, oracle.column_mass(as_np(q), as_np(k), qpos, kpos, SCALE), **TOL[jnp.float32])

    @SWEEP
    @given(st.data())
    def test_shape_sweep(self, data):
        b = data.draw(st.integers(1, 2))
        hkv = data.draw(st.integers(1, 2))
        g = data.draw(st.sampled_from([1, 3]))
        t = data.draw(st.integers(1, 200))
        s = data.draw(st.integers(t, 260))  # a cache with free slots beyond the prompt
        lengths = [data.draw(st.integers(1, t)) for _ in range(b)]
        rng = np.random.default_rng(t)
        q, k, qpos, kpos = make_case(rng, b, hkv, g, t, 16, lengths, jnp.float32, s=s)
        got = self.call(q, k, qpos, kpos)
        assert_close(got, oracle.column_mass(as_np(q), as_np(k), qpos, kpos, SCALE), **TOL[jnp.float32])


class TestColumnMassXla(ColumnMassBase):
    IMPL = "xla"


class TestColumnMassInterpret(ColumnMassBase):
    """The Pallas TPU kernels in interpret mode (NaN-poisoned scratch), on CPU."""

    IMPL = "interpret"


class TestColumnMassTritonInterpret(ColumnMassBase):
    """The Pallas Triton kernels run by the generic Pallas interpreter on CPU (logic only)."""

    def kernel(self):
        return functools.partial(pallas_gpu.column_mass, interpret=True)


class TestColumnMassTpu(ColumnMassBase):
    IMPL = "pallas_tpu"
    pytestmark = tpu_only


class TestColumnMassGpu(ColumnMassBase):
    IMPL = "pallas_gpu"
    pytestmark = gpu_only
