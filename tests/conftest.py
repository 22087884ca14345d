"""Test setup: CPU only, 8 fake devices (set before any JAX computation)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# in-process `python -m kvjax.eval` runs must not turn on (and write) the user's persistent compilation cache
os.environ.setdefault("KVJAX_COMPILATION_CACHE", "off")
# The suite compiles thousands of small XLA programs and runs each a few times, so compile time is most of its
# CPU. At test sizes these flags buy nothing at run time and cut compiles about 2.5x (no numerics flag: fast
# math stays off): LLVM's optimisation passes off, XLA:CPU's MLIR fusion emitters off (the older elemental
# emitters compile the same fusions in a third of the time at -O0), one LLVM module per program instead of
# splits. Subprocesses (CLI tests, notebooks) inherit them. Set XLA_FLAGS to opt out; flags that an XLA no
# longer knows (it would abort) are dropped one by one.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _xla_accepts(flags: str) -> bool:
    """An XLA that does not know a flag aborts the process: try them in a child first (about a second)."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    code = "import jax.numpy as jnp; jnp.zeros(2).block_until_ready()"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


# CPU only: the device check runs the gpu_only / tpu_only tests with JAX_PLATFORMS="" (the accelerator), where
# -O0 would slow the GPU programs themselves.
if "XLA_FLAGS" not in os.environ and os.environ["JAX_PLATFORMS"] == "cpu":
    _flags = " ".join(_FAST_COMPILE)
    if not _xla_accepts(_flags):
        _flags = " ".join(f for f in _FAST_COMPILE if _xla_accepts(f))
    os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pathlib  # noqa: E402

import pytest  # noqa: E402

FIXTURE_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "stories260K-hf"


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops jax's compiled programs after each test module. Every CPU executable keeps its own memory
    mappings; the whole suite compiles thousands of programs in one process, and past the kernel's
    vm.max_map_count (65530) the next compile segfaults."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def stories_path() -> pathlib.Path:
    """The real stories260K checkpoint from ../shared/fixtures (never copied into the repo)."""
    if not FIXTURE_DIR.exists():
        if os.environ.get("CI"):
            pytest.fail(f"fixture folder {FIXTURE_DIR} is missing in CI")
        pytest.skip(f"fixture folder {FIXTURE_DIR} is absent (clone with ../shared beside the repo)")
    return FIXTURE_DIR
