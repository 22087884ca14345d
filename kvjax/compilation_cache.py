"""JAX's persistent compilation cache for kvjax programs: compiled prefill, compression and decode
programs are written to a folder and read back by the next process, so its first call skips XLA's
compile (seconds to minutes for long buckets on CPU).

`enable_compilation_cache()` turns it on (default folder: `default_cache_dir()`,
``$XDG_CACHE_HOME/kvjax/jax`` or ``~/.cache/kvjax/jax``). `python -m kvjax.eval` calls it unless
``--compilation-cache off``. The cache is trusted input to jax: do not share its folder with users
you do not trust.
"""

from __future__ import annotations

import os
import pathlib

import jax

from kvjax import _compat

# Every program gets a file: reading one back takes ~10 ms on CPU, and the default eval's ~110 programs
# that compile in 0.1-0.5 s each would otherwise compile again in every run (~24 s of its warm run).
MIN_COMPILE_TIME_SECS = 0.0


def default_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/kvjax/jax``, else ``~/.cache/kvjax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "kvjax" / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None, *,
                             min_compile_time_secs: float = MIN_COMPILE_TIME_SECS,
                             min_entry_size_bytes: int = -1) -> pathlib.Path:
    """Turns on jax's persistent compilation cache in `path` (default: `default_cache_dir()`), created
    if missing; returns the folder.

    Programs that took at least `min_compile_time_secs` to compile are written (and read back by any
    later process with the same jax, backend and program); `min_entry_size_bytes` -1 writes entries
    of any size. Call it before the first compile of the programs it should cover; calling it again
    moves the cache.
    """
    folder = pathlib.Path(path if path is not None else default_cache_dir()).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    _compat.reset_compilation_cache()
    return folder
