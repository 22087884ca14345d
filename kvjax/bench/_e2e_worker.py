"""kvpress's side of ``python -m kvjax.bench e2e`` in its own process, and the protocol both sides'
worker processes speak (kvjax's side: `kvjax.bench._e2e_kvjax`).

This file imports nothing but the standard library at module level and nothing of kvjax at all, so
that another Python (e.g. a venv with kvpress and its older transformers) runs it by path
(``python -P .../_e2e_worker.py --model ... --request ...``) without jax.

Protocol: the request (token ids and settings) is a JSON file. The worker imports its libraries,
loads the Hugging Face checkpoint folder, writes one JSON line ``{"event": "ready", ...}`` (import and
load seconds, versions) to its stdout, then answers each ``run`` line on stdin with one JSON line
``{"event": "result", "seconds": ..., "tokens": [...]}`` (one whole request, timed inside the process)
until ``quit`` or end of input. Everything else the libraries print goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

START = time.perf_counter()


class _IdsTokenizer:
    """Stands in for the tokenizer of kvpress's pipeline: the answer's ids, written as text."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def kvpress_request(folder: str, request: dict, args: argparse.Namespace) -> tuple[Callable[[], list[int]], dict]:
    """kvpress 0.5.x: SnapKVPress(compression_ratio) on transformers' Llama (sdpa, float32).

    With a question: the body of kvpress's "kv-press-text-generation" pipeline
    (`KVPressTextGenerationPipeline._forward`: the context prefilled under the press, the question fed
    against the compressed cache, greedy answer); token ids in, so its tokenization is left out (as on
    the kvjax side). Without: ``with press(model): model.generate(ids, do_sample=False)``.
    """
    import kvpress
    import torch
    import transformers
    from kvpress import SnapKVPress
    from kvpress.pipeline import KVPressTextGenerationPipeline

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    imported = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # no stop token: every request runs its max_new_tokens
    loaded = time.perf_counter()
    press = SnapKVPress(compression_ratio=request["compression_ratio"])
    context = torch.tensor([request["context"]], dtype=torch.long)
    question = torch.tensor([request["question"]], dtype=torch.long)
    n = int(request["max_new_tokens"])
    pipe = object.__new__(KVPressTextGenerationPipeline)  # _forward reads only .model and .tokenizer
    pipe.model, pipe.tokenizer = model, _IdsTokenizer()

    def run() -> list[int]:
        with torch.no_grad():
            if request["question"]:
                (answer,) = pipe._forward({"context_ids": context, "questions_ids": [question]}, max_new_tokens=n,
                                          press=press)
                return [int(t) for t in answer.split()]
            with press(model):
                out = model.generate(context, attention_mask=torch.ones_like(context), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False)
            return out[0, context.shape[1]:].tolist()

    info = dict(import_s=imported - START, load_s=loaded - imported, threads=torch.get_num_threads(),
                versions=f"torch {torch.__version__}, transformers {transformers.__version__}, "
                         f"kvpress {getattr(kvpress, '__version__', None) or _dist_version('kvpress')}")
    return run, info


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def serve(argv: list[str] | None, make_run: Callable[..., tuple[Callable[[], list[int]], dict]],
          description: str) -> int:
    """The worker's loop: `make_run(folder, request, args)` loads the model and returns the request's
    function and the ready message's fields."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--request", required=True, help="JSON file: context, question, max_new_tokens, ...")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (kvpress side)")
    parser.add_argument("--cache-dir", default=None, help="jax persistent compilation cache folder (kvjax side)")
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel
    os.dup2(2, 1)  # anything printed by the libraries goes to stderr
    sys.stdout = sys.stderr
    with open(args.request) as f:
        request = json.load(f)
    run, info = make_run(args.model, request, args)
    out.write(json.dumps({"event": "ready", **info}) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            continue
        start = time.perf_counter()
        tokens = run()
        out.write(json.dumps({"event": "result", "seconds": time.perf_counter() - start, "tokens": tokens}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(serve(None, kvpress_request, "kvpress's side of python -m kvjax.bench e2e"))
