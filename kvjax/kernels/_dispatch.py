"""Implementation choice for the kernel ops: a table per op (name -> function) and a default order per backend.

``implementation`` (the public argument of every op) is None, one name, or a sequence of names
("the first available one", as tokamax's ``implementation=``). None means the environment
variable ``KVJAX_KERNEL_IMPLEMENTATION`` when set (one name, or several separated by commas),
else the default order of the op on the running backend (`DEFAULT_ORDER`, with per-op exceptions
in `OP_DEFAULT_ORDER`). Availability is a property of
the installed jax (`AVAILABLE`); when nothing asked for is available the error lists what was
asked, what was tried and what is available.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import jax

from kvjax import _compat

ENV_VAR = "KVJAX_KERNEL_IMPLEMENTATION"
IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu", "interpret")

# implementation -> (available in this jax?, why not)
AVAILABLE: dict[str, tuple[Callable[[], bool], str]] = {
    "xla": (lambda: True, ""),
    "pallas_tpu": (lambda: _compat.HAS_PALLAS_TPU, "this jax has no Pallas Mosaic TPU backend"),
    "pallas_gpu": (lambda: _compat.HAS_TRITON, "this jax has no Pallas Triton backend"),
    "interpret": (lambda: _compat.HAS_PALLAS_TPU, "this jax has no Pallas Mosaic TPU backend to interpret"),
}

# jax.default_backend() -> implementations to try, best first (the GPU kernel only while jax ships Triton)
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
    "tpu": ("pallas_tpu", "xla"),
    "gpu": ("pallas_gpu", "xla"),
    "cuda": ("pallas_gpu", "xla"),
    "rocm": ("pallas_gpu", "xla"),
    "cpu": ("xla",),
}


# Per-op exceptions to DEFAULT_ORDER: op -> {backend: order}. The H100 run of the Pallas Triton kernels
# (eval/kernels/README.md, eval/kernels/bench_h100_pallas_gpu*.md) has column_mass 5-7x and decode_attention
# 1.2-1.6x faster than XLA, but window_scores 2-3.5x slower (32 query rows do not fill the GPU): XLA first there.
# The H200 device check (eval/device/nvidia-h200.md) agrees: 6.6-7.4x, 1.3-1.7x and 0.24-0.53x.
OP_DEFAULT_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "window_scores": {"gpu": ("xla", "pallas_gpu"), "cuda": ("xla", "pallas_gpu"), "rocm": ("xla", "pallas_gpu")},
}


def default_order(op: str, backend: str) -> tuple[str, ...]:
    """The implementations `op` tries on `backend` when none is asked for, best first."""
    return OP_DEFAULT_ORDER.get(op, {}).get(backend, DEFAULT_ORDER.get(backend, ("xla",)))


def available_implementations() -> tuple[str, ...]:
    """The implementations this jax can run (or lower), in `IMPLEMENTATIONS` order."""
    return tuple(name for name in IMPLEMENTATIONS if AVAILABLE[name][0]())


def _requested(implementation: str | Sequence[str] | None, op: str) -> tuple[tuple[str, ...], str]:
    """(names to try in order, where they came from)."""
    if implementation is None:
        env = os.environ.get(ENV_VAR)
        if env:
            return tuple(n.strip() for n in env.split(",")), f"${ENV_VAR}={env!r}"
        backend = jax.default_backend()
        return default_order(op, backend), f"the default order of {op} for backend {backend!r}"
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    return names, f"implementation={implementation!r}"


def resolve_implementation(implementation: str | Sequence[str] | None, op: str = "kernel") -> str:
    """The first available implementation among those asked for (see the module docstring); with
    implementation=None, the default order of `op` on the running backend (`default_order`).

    ValueError for a name outside `IMPLEMENTATIONS` (listing them); RuntimeError listing what was
    asked, tried and available when none of the names asked for is available.
    """
    names, source = _requested(implementation, op)
    if not names or any(not isinstance(n, str) or n not in IMPLEMENTATIONS for n in names):
        raise ValueError(f"{op}: {source} is not accepted; implementation must be None, one of "
                         f"{IMPLEMENTATIONS} or a sequence of them")
    tried = []
    for name in names:
        ok, why = AVAILABLE[name]
        if ok():
            return name
        tried.append(f"{name} ({why})")
    raise RuntimeError(f"{op}: no implementation available for {source}; tried {', '.join(tried)}; "
                       f"available here: {', '.join(available_implementations())}")


def late(module: ModuleType, name: str, **fixed: Any) -> Callable[..., Any]:
    """``module.name(*args, **fixed, **kwargs)``, looked up at call time (so a patched module function is used)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(module, name)(*args, **fixed, **kwargs)

    call.__name__ = f"{module.__name__}.{name}"
    return call


def table(op: str, *, xla: ModuleType, pallas_tpu: ModuleType, pallas_gpu: ModuleType) -> KernelTable:
    """The table of an op whose three modules each define a function named ``op``; the TPU kernel
    also serves "interpret" (``interpret=True``, for CPU tests)."""
    return KernelTable(op, {
        "xla": late(xla, op),
        "pallas_tpu": late(pallas_tpu, op),
        "pallas_gpu": late(pallas_gpu, op),
        "interpret": late(pallas_tpu, op, interpret=True),
    })


class KernelTable:
    """One op's implementations: ``table[table.resolve(implementation)](*args, **kwargs)`` runs the chosen one."""

    def __init__(self, op: str, implementations: Mapping[str, Callable[..., Any]]) -> None:
        if missing := set(IMPLEMENTATIONS) - set(implementations):
            raise ValueError(f"{op}: the table lacks implementation(s) {sorted(missing)}")
        self.op = op
        self.implementations = dict(implementations)

    def resolve(self, implementation: str | Sequence[str] | None) -> str:
        return resolve_implementation(implementation, self.op)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self.implementations[name]
