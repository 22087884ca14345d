"""Version shims for JAX / Pallas APIs that move between releases.

Every import of a version-sensitive name goes through here (jax_conventions.md §1.3), so an
API move touches one file. Checked against jax 0.10.2; the Triton backend is deprecated from
jax 0.11 and may disappear, in which case ``HAS_TRITON`` is False and GPU callers fall back to
the XLA path.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported)
from jax.experimental.compilation_cache import compilation_cache

try:  # Mosaic TPU names (``CompilerParams`` was ``TPUCompilerParams`` before jax 0.6).
    from jax.experimental.pallas import tpu as pltpu

    _TPU_COMPILER_PARAMS = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
except ImportError:  # pragma: no cover - every supported jax ships Mosaic TPU
    pltpu = None
    _TPU_COMPILER_PARAMS = None

try:  # Triton backend: deprecated in jax 0.11, slated for removal (moving to openxla/tokamax).
    from jax.experimental.pallas import triton as pltriton

    HAS_TRITON = hasattr(pltriton, "CompilerParams")
except ImportError:  # pragma: no cover - depends on the installed jax
    pltriton = None
    HAS_TRITON = False

HAS_PALLAS_TPU = pltpu is not None and hasattr(pltpu, "PrefetchScalarGridSpec")

try:  # jax's splash attention (Mosaic TPU flash attention with block-sparse masks)
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    HAS_SPLASH = hasattr(splash_kernel, "make_splash_mqa_single_device")
except ImportError:  # pragma: no cover - depends on the installed jax
    splash_kernel = splash_mask = None
    HAS_SPLASH = False


def tpu_compiler_params(dimension_semantics: tuple[str, ...], vmem_limit_bytes: int | None = None) -> Any:
    """Mosaic compiler parameters for a grid with the given per-axis semantics."""
    if _TPU_COMPILER_PARAMS is None:  # pragma: no cover
        raise RuntimeError("this jax has no Pallas TPU backend")
    kwargs: dict[str, Any] = {"dimension_semantics": tuple(dimension_semantics)}
    if vmem_limit_bytes is not None:
        kwargs["vmem_limit_bytes"] = vmem_limit_bytes
    return _TPU_COMPILER_PARAMS(**kwargs)


def triton_compiler_params(num_warps: int = 4, num_stages: int = 2) -> Any:
    """Triton compiler parameters; passing them is what selects the Triton lowering on GPU."""
    if not HAS_TRITON:
        raise RuntimeError(
            f"jax {jax.__version__} has no Pallas Triton backend; use implementation='xla' on GPU"
        )
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def tpu_interpret_params() -> Any:
    """Interpret-mode setting for Mosaic kernels on CPU.

    ``InterpretParams`` simulates TPU semantics (uninitialised VMEM is NaN-poisoned), which
    makes forgotten initialisation visible; older jax only has the generic interpreter.
    """
    params = getattr(pltpu, "InterpretParams", None) if pltpu is not None else None
    return params() if params is not None else True


def prefetch_scalar_grid_spec(**kwargs: Any) -> Any:
    """``pltpu.PrefetchScalarGridSpec`` (scalar-prefetch arguments land in SMEM)."""
    return pltpu.PrefetchScalarGridSpec(**kwargs)


def vmem(shape: tuple[int, ...], dtype: Any) -> Any:
    """A VMEM scratch buffer description."""
    return pltpu.VMEM(shape, dtype)


def reset_compilation_cache() -> None:
    """Makes jax re-read its persistent compilation cache settings (``reset_cache``: a cache already
    checked, or initialised at another path, would otherwise stay as it was)."""
    compilation_cache.reset_cache()
