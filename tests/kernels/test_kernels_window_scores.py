"""window_scores: every implementation against the NumPy oracle (kernel_oracles.window_scores)."""

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
from kvjax.kernels.window_scores import pallas_gpu

MOMENTS = ("sum", "sumsq", "entropy")


def make_case(rng, b, hkv, g, w, s, d, lengths, dtype, poison=True):
    q = rng.normal(size=(b, hkv * g, w, d)).astype(np.float32)
    k = rng.normal(size=(b, hkv, s, d)).astype(np.float32)
    kpos = oracle.right_padded_positions(lengths, hkv, s)
    qpos = oracle.window_positions(lengths, w)
    if poison:
        k = oracle.poison_keys(k, kpos)
    q, k = jnp.asarray(q, dtype), jnp.asarray(k, dtype)
    return q, k, jnp.asarray(qpos), jnp.asarray(kpos)


class WindowScoresBase:
    IMPL: str = "xla"

    def call(self, *args, **kw):
        return jax.jit(functools.partial(kernels.window_scores, implementation=self.IMPL, **kw))(*args)

    @pytest.mark.parametrize("group_reduce", ["mean", "sum", "max", None])
    def test_matches_oracle_gqa_ragged(self, group_reduce):
        rng = np.random.default_rng(0)
        # S = 640: several key blocks; row 1 is short, so its tail slots are empty (NaN-poisoned).
        q, k, qpos, kpos = make_case(rng, 2, 2, 3, 8, 640, 32, [600, 131], jnp.float32)
        kpos = kpos.at[1, 1, 40:60].set(-1)  # a hole inside the prompt of one head
        got = self.call(q, k, qpos, kpos, scale=0.3, group_reduce=group_reduce, moments=MOMENTS)
        want = oracle.window_scores(as_np(q), as_np(k), qpos, kpos, 0.3, group_reduce, MOMENTS)
        for m in MOMENTS:
            shape = (2, 2, 3, 640) if group_reduce is None else (2, 2, 640)
            assert got[m].shape == shape and got[m].dtype == jnp.float32
            assert_close(got[m], want[m], **TOL[jnp.float32])
        # Mass is conserved: each (head, query) distributes exactly 1 over the keys it sees.
        if group_reduce == "sum":
            np.testing.assert_allclose(as_np(got["sum"]).sum(-1), 3 * 8, rtol=1e-5)

    def test_bfloat16_inputs(self):
        rng = np.random.default_rng(1)
        q, k, qpos, kpos = make_case(rng, 1, 2, 2, 16, 256, 64, [200], jnp.bfloat16)
        got = self.call(q, k, qpos, kpos, scale=0.125, group_reduce="mean", moments=MOMENTS)
        want = oracle.window_scores(as_np(q), as_np(k), qpos, kpos, 0.125, "mean", MOMENTS)
        for m in MOMENTS:
            assert got[m].dtype == jnp.float32
            assert_close(got[m], want[m], **TOL[jnp.bfloat16])

    def test_empty_head_and_blind_query_give_zeros(self):
        rng = np.random.default_rng(2)
        q, k, qpos, kpos = make_case(rng, 2, 2, 2, 4, 128, 16, [100, 60], jnp.float32)
        kpos = kpos.at[0, 1].set(-1)  # a KV head with no token at all
        k = k.at[0, 1].set(jnp.nan)
        qpos = qpos.at[1, 0].set(-1)  # a window query that sees nothing (and NaN in it)
        q = q.at[1, :, 0].set(jnp.nan)
        got = self.call(q, k, qpos, kpos, scale=0.25, group_reduce=None, moments=MOMENTS)
        want = oracle.window_scores(as_np(q), as_np(k), qpos, kpos, 0.25, None, MOMENTS)
        for m in MOMENTS:
            out = as_np(got[m])
            assert np.all(out[0, 1] == 0.0)
            assert_close(out, want[m], **TOL[jnp.float32])
        # The blind query contributes nothing: the row sums to the 3 other queries per head.
        np.testing.assert_allclose(as_np(got["sum"])[1].sum(-1), 3.0, rtol=1e-5)

    @SWEEP
    @given(st.data())
    def test_shape_sweep(self, data):
        b = data.draw(st.integers(1, 2))
        hkv = data.draw(st.integers(1, 2))
        g = data.draw(st.sampled_from([1, 2, 4]))
        w = data.draw(st.integers(1, 9))
        s = data.draw(st.integers(w, 300))
        lengths = [data.draw(st.integers(w, s)) for _ in range(b)]
        reduce_ = data.draw(st.sampled_from(["mean", "max", None]))
        rng = np.random.default_rng(s)
        q, k, qpos, kpos = make_case(rng, b, hkv, g, w, s, 16, lengths, jnp.float32)
        got = self.call(q, k, qpos, kpos, scale=0.5, group_reduce=reduce_, moments=("sum", "entropy"))
        want = oracle.window_scores(as_np(q), as_np(k), qpos, kpos, 0.5, reduce_, ("sum", "entropy"))
        for m in ("sum", "entropy"):
            assert_close(got[m], want[m], **TOL[jnp.float32])


class TestWindowScoresXla(WindowScoresBase):
    IMPL = "xla"


class TestWindowScoresInterpret(WindowScoresBase):
    """The Pallas TPU kernel in interpret mode (NaN-poisoned scratch), on CPU."""

    IMPL = "interpret"


class TestWindowScoresTritonInterpret(WindowScoresBase):
    """The Pallas Triton kernel run by the generic Pallas interpreter on CPU (logic only)."""

    def call(self, *args, **kw):
        return jax.jit(functools.partial(pallas_gpu.window_scores, interpret=True, **kw))(*args)


class TestWindowScoresTpu(WindowScoresBase):
    IMPL = "pallas_tpu"
    pytestmark = tpu_only


class TestWindowScoresGpu(WindowScoresBase):
    IMPL = "pallas_gpu"
    pytestmark = gpu_only
