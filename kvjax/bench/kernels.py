"""``python -m kvjax.bench kernels``: each scoring kernel beside its XLA reference.

For every op and size: median wall time of the kernel implementation and of the XLA reference
(jitted, after one compile run), and on TPU/GPU the achieved fraction of peak HBM bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import kernels
from kvjax.bench import _timing
from kvjax.kernels.attention import Keys, attention

HELP = ("time the scoring kernels (window_scores, column_mass, decode_attention) and the prefill attention "
        "against their XLA references")
OPS = ("window_scores", "column_mass", "decode_attention", "prefill_attention")

# (batch, query heads, KV heads, head_dim, window) and the key lengths per op.
SIZES = {
    # Seconds in the Pallas interpreter on a busy CPU (`python -m kvjax.bench device`'s CPU / --tiny mode).
    "micro": dict(b=1, hq=4, hkv=2, d=128, w=16, window=(512,), column=(256,), decode=(512,)),
    # Small enough for the Pallas interpreter on a laptop CPU.
    "tiny": dict(b=1, hq=8, hkv=2, d=128, w=32, window=(2048, 8192), column=(512, 1024), decode=(2048, 8192)),
    # Llama-3-8B-like attention shapes.
    "production": dict(b=1, hq=32, hkv=8, d=128, w=32, window=(8192, 32768), column=(8192, 32768),
                       decode=(8192, 32768)),
}


@dataclasses.dataclass
class Case:
    op: str
    shape: str
    args: tuple[Any, ...]
    call: Callable[..., Callable[..., Any]]  # implementation -> jitted function of args
    bytes_min: int  # one read of every input, one write of every output
    flops: float  # work the kernel does (both passes for the two-pass ops; causal half for prefill)


def _positions(b: int, hkv: int, s: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, hkv, s))


def build_cases(size: str, ops: tuple[str, ...], dtype: Any) -> list[Case]:
    cfg = SIZES[size]
    b, hq, hkv, d, w = cfg["b"], cfg["hq"], cfg["hkv"], cfg["d"], cfg["w"]
    item = jnp.dtype(dtype).itemsize
    scale = 1.0 / math.sqrt(d)
    rngs = iter(jax.random.split(jax.random.PRNGKey(0), 64))

    def normal(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(rngs), shape, dtype)

    cases = []
    if "window_scores" in ops:
        for s in cfg["window"]:
            args = (normal((b, hq, w, d)), normal((b, hkv, s, d)),
                    jnp.broadcast_to(jnp.arange(s - w, s, dtype=jnp.int32), (b, w)), _positions(b, hkv, s))
            call = lambda impl: jax.jit(functools.partial(  # noqa: E731
                kernels.window_scores, scale=scale, group_reduce="mean", moments=("sum",), implementation=impl))
            nbytes = (b * hq * w * d + b * hkv * s * d) * item + b * hkv * s * 8
            cases.append(Case("window_scores", f"B{b} Hq{hq} Hkv{hkv} w{w} S{s} D{d}", args, call, nbytes,
                              2 * 2.0 * b * hq * w * s * d))
    if "column_mass" in ops:
        for s in cfg["column"]:
            args = (normal((b, hq, s, d)), normal((b, hkv, s, d)),
                    jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), _positions(b, hkv, s))
            call = lambda impl: jax.jit(functools.partial(  # noqa: E731
                kernels.column_mass, scale=scale, implementation=impl))
            nbytes = (b * hq * s * d + b * hkv * s * d) * item + b * s * 4 + b * hkv * s * 8
            cases.append(Case("column_mass", f"B{b} Hq{hq} Hkv{hkv} T=S={s} D{d}", args, call, nbytes,
                              2 * 2.0 * b * hq * d * s * s / 2))
    if "decode_attention" in ops:
        for s in cfg["decode"]:
            valid = jax.random.uniform(next(rngs), (b, hkv, s)) < 0.9  # a cache after some evictions
            args = (normal((b, hq, d)), normal((b, hkv, s, d)), normal((b, hkv, s, d)), valid)
            call = lambda impl: jax.jit(functools.partial(  # noqa: E731
                kernels.decode_attention, scale=scale, implementation=impl))
            nbytes = 2 * b * hkv * s * d * item + b * hkv * s + b * hq * s * 4 + 2 * b * hq * d * item
            cases.append(Case("decode_attention", f"B{b} Hq{hq} Hkv{hkv} S{s} D{d}", args, call, nbytes,
                              2 * 2.0 * b * hq * s * d))
    if "prefill_attention" in ops:
        for s in cfg["column"]:
            pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            args = (normal((b, hq, s, d)), normal((b, hkv, s, d)), normal((b, hkv, s, d)), pos, _positions(b, hkv, s))
            cases.append(Case("prefill_attention", f"B{b} Hq{hq} Hkv{hkv} T=S={s} D{d}", args,
                              functools.partial(_prefill_attention, scale=scale),
                              (2 * b * hq * s * d + 2 * b * hkv * s * d) * item + b * s * 4 + b * hkv * s * 4,
                              2 * 2.0 * b * hq * d * s * s / 2))
    return cases


def _prefill_attention(impl: str, *, scale: float) -> Callable[..., Any]:
    """A prefill's causal self-attention through the attention op: the kernel column is the op's default
    order on this backend (cuDNN on GPUs, splash on TPUs, flash elsewhere), the XLA column `flash_xla`."""
    order = "flash" if impl == "xla" else None
    return jax.jit(lambda q, k, v, qp, kp: attention(q, Keys(k, v, kp), qp, scale=scale, own_keys=True,
                                                     implementation=order).out)


def default_kernel_impl() -> str:
    backend = jax.default_backend()
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "interpret")


def kernel_column_note(impl: str) -> str:
    if impl == "interpret":
        return ("the Pallas TPU kernel run by the Pallas interpreter on CPU: it checks that the kernel runs, "
                "its time says nothing about TPU speed")
    if impl == "xla":
        return "the XLA reference itself (both columns run the same code)"
    return f"the compiled Pallas kernel ({impl})"


def run_cases(cases: list[Case], impl: str, repeats: int) -> list[list[Any]]:
    peak = _timing.peak_bandwidth_gbps()
    rows = []
    for case in cases:
        t_kernel = _timing.median_seconds(case.call(impl), case.args, repeats)
        t_xla = _timing.median_seconds(case.call("xla"), case.args, repeats)
        gbps = case.bytes_min / t_kernel / 1e9
        rows.append([case.op, case.shape, f"{t_kernel * 1e3:.3f}", f"{t_xla * 1e3:.3f}", f"{t_xla / t_kernel:.2f}x",
                     f"{gbps:.3g}", "n/a" if peak is None else f"{100 * gbps / peak:.1f}%",
                     f"{case.flops / t_kernel / 1e12:.3g}"])
        print(" | ".join(str(x) for x in rows[-1]), flush=True)
    return rows


COLUMNS = ("op", "shape", "kernel ms", "xla ms", "xla/kernel", "kernel GB/s", "% peak HBM BW", "kernel TFLOP/s")


def report(rows: list[list[Any]], impl: str, size: str, dtype: str, repeats: int) -> str:
    lines = ["# kvjax scoring kernels vs XLA reference", ""] + _timing.header_lines() + [
        f"- kernel column: `{impl}` = {kernel_column_note(impl)}",
        "- xla column: the pure-jnp reference (`implementation=\"xla\"`), jitted",
        f"- sizes: `{size}`, inputs {dtype}; median of {repeats} runs after one compile run",
        "- GB/s counts one read of every input and one write of every output; the two-pass scoring ops "
        "(window_scores, column_mass) read the keys twice by design, and column_mass is compute-bound, "
        "so its bandwidth fraction is low by nature (see TFLOP/s)",
        "- prefill_attention: the kernel column is the attention op's default order on this backend (cuDNN's "
        "fused attention on GPUs, splash on TPUs, `flash_xla` on CPUs), the xla column `flash_xla`",
        "", _timing.markdown_table(COLUMNS, rows), ""]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", choices=sorted(SIZES), default=None,
                        help="size preset (default: tiny on CPU, production on TPU/GPU)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    parser.add_argument("--impl", default=None, choices=kernels.IMPLEMENTATIONS,
                        help="kernel column implementation (default: pallas on TPU/GPU, interpret on CPU)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median reported)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown table here")


def run(args: argparse.Namespace) -> int:
    ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    unknown = set(ops) - set(OPS)
    if unknown:
        raise SystemExit(f"--ops: unknown {sorted(unknown)}; accepted: {OPS}")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    size = args.sizes or ("tiny" if jax.default_backend() == "cpu" else "production")
    impl = args.impl or default_kernel_impl()
    print(f"# device: {_timing.describe_device()}; kernel column = {impl}; sizes = {size}", flush=True)
    print(" | ".join(COLUMNS), flush=True)
    rows = run_cases(build_cases(size, ops, jnp.dtype(args.dtype)), impl, args.repeats)
    text = report(rows, impl, size, args.dtype, args.repeats)
    print()
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0
