"""Backend markers and tolerances shared by the kernel test classes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

tpu_only = [pytest.mark.tpu_only,
            pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU backend")]
gpu_only = [pytest.mark.gpu_only,
            pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")]

# Scores are float32 in every implementation; bf16 only changes the inputs, which the oracle
# sees exactly (it is fed the bf16 values), so the bf16 tolerance covers accumulation order
# and the bf16 rounding of P before P.V in decode (output only).
TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-6), jnp.bfloat16: dict(rtol=1e-4, atol=1e-5)}
OUT_TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def as_np(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def assert_close(actual, expected, **tol) -> None:
    actual = as_np(actual)
    assert np.isfinite(actual).all(), "non-finite values escaped"
    np.testing.assert_allclose(actual, np.asarray(expected, np.float64), **tol)


# Few examples (each new shape compiles a kernel); the same test body runs once per backend
# subclass, which is what the differing_executors health check would otherwise flag.
SWEEP = settings(max_examples=3, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.differing_executors])
