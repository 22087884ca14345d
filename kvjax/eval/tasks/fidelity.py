"""Fidelity samples: a context to compress and a continuation to teacher-force (any model, any text).

Each sample holds ``context_ids`` (``context_length - continuation_tokens`` tokens) and
``continuation_ids`` (``continuation_tokens`` tokens). The runner asks for the next-token
logits over the continuation with the full and with the compressed cache and scores
KL(full || compressed) and top-1 agreement (``metrics.fidelity``).

Sources, in order: ``data["fidelity_ids"]`` (a ``.npy`` or ``.json`` list of token ids, for
models without a tokenizer such as the stories260K fixture), ``data["fidelity"]`` (a text
file), else the built-in prose (needs a tokenizer). Sample i reads the source from offset
``i * stride`` (cycling), or, for the built-in prose, a prose stream of its own.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from kvjax.data.base import Options, Sample, TaskSkipped, encode
from kvjax.data.prose import ProseStream

CONTINUATION_TOKENS = 32


def _ids_file(path: str) -> list[int]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise TaskSkipped(f"fidelity: the token-id file {path!r} does not exist")
    ids = np.load(p) if p.suffix == ".npy" else np.asarray(json.loads(p.read_text()))
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"fidelity: {path!r} must hold a 1-D list of int token ids, got {ids.dtype} {ids.shape}")
    return ids.tolist()


def fidelity(task: str, opts: Options, continuation_tokens: int = CONTINUATION_TOKENS) -> list[Sample]:
    """``num_samples`` windows of ``context_length`` tokens, split into context and continuation."""
    if not 0 < continuation_tokens < opts.context_length:
        raise ValueError(f"continuation_tokens must be in (0, context_length={opts.context_length}), "
                         f"got {continuation_tokens}")
    n_ctx = opts.context_length - continuation_tokens
    data = opts.data or {}
    source: list[int] | None = None
    if data.get("fidelity_ids"):
        source = _ids_file(data["fidelity_ids"])
    elif opts.tokenizer is None:
        raise TaskSkipped("fidelity on a model without a tokenizer needs token ids: --data fidelity_ids=PATH "
                          "(.npy or .json)")
    elif data.get("fidelity"):
        source = encode(opts.tokenizer, pathlib.Path(data["fidelity"]).read_text(encoding="utf-8"))
    if source is not None and len(source) == 0:
        raise ValueError("fidelity: the token source is empty")
    samples = []
    for i in range(opts.num_samples):
        if source is None:
            stream, words = ProseStream(seed=opts.seed * 7919 + i), opts.context_length
            while len(ids := encode(opts.tokenizer, " ".join(stream.words(words)))) < opts.context_length:
                words *= 2
            window = ids[: opts.context_length]
        else:
            start = (i * (opts.context_length // 2)) % len(source)
            window = (source * (opts.context_length // len(source) + 2))[start: start + opts.context_length]
        samples.append(Sample(
            id=f"{task}/{i}", task=task, context="", question="", answer_prefix="", answers=[],
            max_new_tokens=0, chat_template=False, length=len(window), target_length=opts.context_length,
            metadata={"context_ids": window[:n_ctx], "continuation_ids": window[n_ctx:]},
        ))
    return samples
