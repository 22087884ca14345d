"""kvjax's side of ``python -m kvjax.bench e2e`` in its own process (the protocol of
`kvjax.bench._e2e_worker`). The bench runs this file by path (``python -P .../_e2e_kvjax.py``, kvjax on
PYTHONPATH) so that the clock starts before jax and kvjax are imported, as on kvpress's side.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402

import kvjax  # noqa: E402
from kvjax.bench._e2e_worker import serve  # noqa: E402


def generate_tokens(model: kvjax.Model, request: dict) -> list[int]:
    """The request on kvjax: `kvjax.generate` with the `snapkv_kvpress` preset, the context and question
    as kvpress's pipeline takes them (or the plain prompt), greedy, no stop token; the answer's ids."""
    out = kvjax.generate(model, [request["context"]], questions=[request["question"]] if request["question"] else None,
                         policy=request.get("policy", "snapkv_kvpress"), compression_ratio=request["compression_ratio"],
                         max_new_tokens=int(request["max_new_tokens"]), stop_tokens=[])
    return [int(t) for t in out.tokens[0, :int(out.lengths[0])]]


def kvjax_request(folder: str, request: dict, args: argparse.Namespace) -> tuple[Callable[[], list[int]], dict]:
    """Loads the checkpoint (float32) after turning on the persistent compilation cache in `--cache-dir`."""
    if args.cache_dir:
        kvjax.enable_compilation_cache(args.cache_dir)
    imported = time.perf_counter()
    model = kvjax.load_model(folder, dtype="float32", tokenizer=False)
    jax.block_until_ready(model.params)
    loaded = time.perf_counter()
    info = {"import_s": imported - START, "load_s": loaded - imported, "threads": os.cpu_count(),
            "versions": f"jax {jax.__version__}, kvjax {kvjax.__version__}"}
    return (lambda: generate_tokens(model, request)), info


if __name__ == "__main__":
    sys.exit(serve(None, kvjax_request, "kvjax's side of python -m kvjax.bench e2e"))
