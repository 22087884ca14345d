"""Dispatcher: implementation choice per backend, routing, and argument validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import _compat, kernels
from kvjax.kernels import _common, _dispatch
from kvjax.kernels.column_mass import api as column_api
from kvjax.kernels.decode_attention import api as decode_api
from kvjax.kernels.window_scores import api as window_api


def tiny():
    q = jnp.ones((1, 4, 3, 8), jnp.float32)
    k = jnp.ones((1, 2, 16, 8), jnp.float32)
    qpos = jnp.array([[13, 14, 15]], jnp.int32)
    kpos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (1, 2, 16))
    return q, k, qpos, kpos


def test_public_names():
    assert set(kernels.__all__) >= {"window_scores", "column_mass", "decode_attention"}
    assert kernels.IMPLEMENTATIONS == ("xla", "pallas_tpu", "pallas_gpu", "interpret")


@pytest.mark.parametrize(
    "backend, expected",
    [("cpu", "xla"), ("tpu", "pallas_tpu"), ("gpu", "pallas_gpu" if _compat.HAS_TRITON else "xla")],
)
def test_auto_choice_per_backend(monkeypatch, backend, expected):
    monkeypatch.delenv(_common.ENV_VAR, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert _common.resolve_implementation(None) == expected


@pytest.mark.parametrize("backend", ["gpu", "cuda", "rocm", "tpu", "cpu"])
def test_default_order_per_op(monkeypatch, backend):
    """window_scores keeps XLA first on GPU (its Pallas kernel measured 2-3.5x slower on an H100,
    eval/kernels/README.md); column_mass and decode_attention keep their Pallas kernel first."""
    monkeypatch.delenv(_common.ENV_VAR, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    gpu = backend in ("gpu", "cuda", "rocm")
    pallas = {"tpu": "pallas_tpu", "cpu": "xla"}.get(backend, "pallas_gpu" if _compat.HAS_TRITON else "xla")
    assert window_api.TABLE.resolve(None) == ("xla" if gpu else pallas)
    assert column_api.TABLE.resolve(None) == pallas
    assert decode_api.TABLE.resolve(None) == pallas
    assert _dispatch.default_order("window_scores", backend)[0] == ("xla" if gpu else _dispatch.DEFAULT_ORDER[backend][0])
    for op in ("column_mass", "decode_attention"):
        assert _dispatch.default_order(op, backend) == _dispatch.DEFAULT_ORDER[backend]
    monkeypatch.setenv(_common.ENV_VAR, "pallas_tpu")  # the override still wins
    assert window_api.TABLE.resolve(None) == "pallas_tpu"


def test_auto_is_xla_on_this_cpu(monkeypatch):
    monkeypatch.delenv(_common.ENV_VAR, raising=False)
    assert jax.default_backend() == "cpu"
    assert _common.resolve_implementation(None) == "xla"


@pytest.mark.parametrize("fn", ["window_scores", "column_mass", "decode_attention"])
def test_unknown_implementation_lists_accepted_values(fn):
    q, k, qpos, kpos = tiny()
    calls = {
        "window_scores": lambda impl: kernels.window_scores(q, k, qpos, kpos, scale=1.0, implementation=impl),
        "column_mass": lambda impl: kernels.column_mass(q, k, qpos, kpos, scale=1.0, implementation=impl),
        "decode_attention": lambda impl: kernels.decode_attention(
            q[:, :, 0], k, k, kpos >= 0, scale=1.0, implementation=impl),
    }
    with pytest.raises(ValueError) as err:
        calls[fn]("triton")
    for name in ("xla", "pallas_tpu", "pallas_gpu", "interpret"):
        assert name in str(err.value)


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu", "interpret", None])
def test_routing(monkeypatch, impl):
    """Each implementation string reaches its backend module and no other."""
    monkeypatch.delenv(_common.ENV_VAR, raising=False)
    seen = []

    def fake(tag):
        def f(*args, **kw):
            seen.append(tag)
            return "sentinel"
        return f

    for api in (window_api, column_api, decode_api):
        name = api.__name__.split(".")[-2]
        monkeypatch.setattr(api.reference, name, fake("xla"))
        monkeypatch.setattr(api.pallas_gpu, name, fake("pallas_gpu"))
        monkeypatch.setattr(api.pallas_tpu, name,
                            lambda *a, interpret=False, **kw: seen.append("interpret" if interpret else "pallas_tpu"))
    q, k, qpos, kpos = tiny()
    kernels.window_scores(q, k, qpos, kpos, scale=1.0, implementation=impl)
    kernels.column_mass(q, k, qpos, kpos, scale=1.0, implementation=impl)
    kernels.decode_attention(q[:, :, 0], k, k, kpos >= 0, scale=1.0, implementation=impl)
    assert seen == [impl or "xla"] * 3


def test_bad_arguments_name_the_argument():
    q, k, qpos, kpos = tiny()
    with pytest.raises(ValueError, match="group_reduce"):
        kernels.window_scores(q, k, qpos, kpos, scale=1.0, group_reduce="median")
    with pytest.raises(ValueError, match="moments"):
        kernels.window_scores(q, k, qpos, kpos, scale=1.0, moments=("variance",))
    with pytest.raises(ValueError, match="moments"):
        kernels.window_scores(q, k, qpos, kpos, scale=1.0, moments=())
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kernels.window_scores(q[:, :3], k, qpos, kpos, scale=1.0)
    with pytest.raises(ValueError, match="key_positions"):
        kernels.window_scores(q, k, qpos, kpos[:, :, :8], scale=1.0)
    with pytest.raises(ValueError, match="query_positions"):
        kernels.column_mass(q, k, qpos[:, :2], kpos, scale=1.0)
    with pytest.raises(TypeError, match="queries"):
        kernels.column_mass(q.astype(jnp.int32), k, qpos, kpos, scale=1.0)
    with pytest.raises(TypeError, match="key_positions"):
        kernels.column_mass(q, k, qpos, kpos.astype(jnp.float32), scale=1.0)
    with pytest.raises(ValueError, match="lse"):
        kernels.column_mass(q, k, qpos, kpos, scale=1.0, lse=jnp.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match="scale"):
        kernels.column_mass(q, k, qpos, kpos, scale=-1.0)
    with pytest.raises(TypeError, match="valid"):
        kernels.decode_attention(q[:, :, 0], k, k, kpos, scale=1.0)
    with pytest.raises(ValueError, match="values"):
        kernels.decode_attention(q[:, :, 0], k, k[:, :, :4], kpos >= 0, scale=1.0)


def test_traced_scale_is_rejected():
    q, k, qpos, kpos = tiny()
    with pytest.raises(TypeError, match="scale"):
        jax.jit(lambda s: kernels.column_mass(q, k, qpos, kpos, scale=s))(1.0)


def test_mixed_dtypes_are_promoted():
    q, k, qpos, kpos = tiny()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    k = jnp.asarray(rng.normal(size=k.shape), jnp.bfloat16)
    mixed = kernels.window_scores(q, k, qpos, kpos, scale=0.5)["sum"]
    same = kernels.window_scores(q, k.astype(jnp.float32), qpos, kpos, scale=0.5)["sum"]
    np.testing.assert_allclose(np.asarray(mixed), np.asarray(same), rtol=1e-6)


def test_environment_variable_overrides_auto_choice(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setenv("KVJAX_KERNEL_IMPLEMENTATION", "xla")
    assert _common.resolve_implementation(None) == "xla"
    assert _common.resolve_implementation("interpret") == "interpret"  # an explicit argument wins
    monkeypatch.setenv("KVJAX_KERNEL_IMPLEMENTATION", "cuda")
    with pytest.raises(ValueError, match="pallas_gpu"):
        _common.resolve_implementation(None)


def test_every_op_has_a_complete_table():
    for api in (window_api, column_api, decode_api):
        assert set(api.TABLE.implementations) == set(kernels.IMPLEMENTATIONS)


def test_a_sequence_takes_the_first_available(monkeypatch):
    """Without Triton, ("pallas_gpu", "xla") falls back to xla; the auto choice on GPU too."""
    monkeypatch.delenv(_common.ENV_VAR, raising=False)
    monkeypatch.setattr(_compat, "HAS_TRITON", False)
    assert _common.resolve_implementation(("pallas_gpu", "xla")) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _common.resolve_implementation(None) == "xla"
    monkeypatch.setattr(_compat, "HAS_TRITON", True)
    assert _common.resolve_implementation(("pallas_gpu", "xla")) == "pallas_gpu"
    monkeypatch.setenv(_common.ENV_VAR, "pallas_tpu, xla")
    assert _common.resolve_implementation(None) == "pallas_tpu"


def test_nothing_available_lists_asked_tried_and_available(monkeypatch):
    monkeypatch.setattr(_compat, "HAS_TRITON", False)
    q, k, qpos, kpos = tiny()
    with pytest.raises(RuntimeError) as err:
        kernels.column_mass(q, k, qpos, kpos, scale=1.0, implementation="pallas_gpu")
    msg = str(err.value)
    assert "column_mass" in msg and "implementation='pallas_gpu'" in msg and "Triton" in msg
    assert msg.endswith("available here: xla, pallas_tpu, interpret")
    with pytest.raises(ValueError, match="implementation"):
        _common.resolve_implementation(())


def test_shared_reductions_against_numpy():
    from kvjax.kernels import reductions
    from kvjax.policies.scoring import group_reduce_fn

    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7), size=(2, 3)).astype(np.float32)  # [2, 3 members, 7 keys]
    expect = {"sum": p, "sumsq": p ** 2, "entropy": -p * np.log(p + 1e-10)}
    for moment, ref in expect.items():
        np.testing.assert_allclose(np.asarray(reductions.moment_contribution(moment, jnp.asarray(p))), ref,
                                   rtol=1e-6)
    for how, fn in (("mean", np.mean), ("sum", np.sum), ("max", np.max)):
        ref = fn(p, axis=1)
        np.testing.assert_allclose(np.asarray(group_reduce_fn(jnp.asarray(p), how, axis=1)), ref, rtol=1e-6)
        rows = [jnp.asarray(p[:, g]) for g in range(3)]
        if how != "max":  # the kernels hand "sum" / "mean" one row already summed over the group
            rows = [sum(rows[1:], rows[0])]
        np.testing.assert_allclose(np.asarray(reductions.combine_group_rows(rows, how, 3)), ref, rtol=1e-6)
