"""The real model behind the runner: `kvjax.load_model` and `kvjax.generate`, wrapped as the
runner's ``generate_fn`` / ``logits_fn``. Imported only when a real run needs it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from kvjax import engine
from kvjax.data.prompts import build_prompt, encode_prompt
from kvjax.engine.api import check_cache_layout
from kvjax.models import load_model
from kvjax.models.gguf import GGUFFile, config_dict, is_gguf
from kvjax.models.model import BUNDLED, BUNDLED_MODEL_DIR, resolve_model

__all__ = ["BUNDLED_MODEL_DIR", "load", "make_generate_fn", "make_logits_fn"]


def model_positions(spec: str | None) -> tuple[int | None, str]:
    """The model's max_position_embeddings, read without loading its weights (a folder's
    config.json, or a GGUF file's metadata), and the file it came from; (None, "") for a Hub id
    or a file that cannot be read here (loading then reports the problem)."""
    resolved = resolve_model(spec)
    if is_gguf(resolved):
        try:
            value = config_dict(GGUFFile(resolved)).get("max_position_embeddings")
        except (OSError, ValueError):
            return None, ""
        return (int(value) if value is not None else None), resolved
    path = pathlib.Path(resolved) / "config.json"
    if not path.is_file():
        return None, ""
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None, ""
    return (int(value) if isinstance(value, int) else None), str(path)


def load(spec: str | None) -> Any:
    """The `kvjax.models.Model` for ``spec``: a folder, a Hub id, a ``.gguf`` file or ``bundled`` (None)."""
    return load_model(BUNDLED if spec is None else spec)


def _split_ids(samples: list[dict[str, Any]], tokenizer: Any, query_aware: bool) -> tuple[list, list]:
    contexts, questions = [], []
    for s in samples:
        ctx, q = encode_prompt(build_prompt(s, tokenizer, query_aware), tokenizer)
        if not q:  # nothing to feed after compression: the last context token becomes the question
            ctx, q = ctx[:-1], ctx[-1:]
        contexts.append(ctx)
        questions.append(q)
    return contexts, questions


def cache_stats(out: engine.GenerateOutput, b: int) -> dict[str, Any]:
    """Row b's cache as it really was while the row decoded: entries per KV head (peak, mean; the
    average over layers and heads), their key/value bytes in the model dtype and at 16 bits per element
    (kv_bytes16_*: the codes, scales and zero points of a quantized cache), the nominal budget and
    whether the cache ever came down to it (None for the full cache). The decode loop runs to the row's stop token or
    the batch's largest task cap, so a row cut to a shorter task cap is counted over the longer decode."""
    stats: dict[str, Any] = {}
    for key in ("kept_peak", "kept_mean", "kv_bytes_peak", "kv_bytes_mean", "kv_bytes16_peak", "kv_bytes16_mean"):
        value = getattr(out, key)
        if value is not None:
            stats[key] = int(round(float(value[b]))) if key.startswith("kv_bytes") else round(float(value[b]), 2)
    stats["budget"] = None if out.budget is None else int(out.budget[b])
    stats["budget_reached"] = None if out.budget_reached is None else bool(out.budget_reached[b])
    return stats


def make_generate_fn(model: Any, pad_to: int | None = None, min_new_tokens: int = 128, cache_layout: str = "dense"):
    """A runner ``generate_fn`` calling `kvjax.generate` in context-then-question mode, greedy.

    pad_to: batches smaller than this are padded with copies of their last row (answers dropped),
    so that a partial last batch reuses the compiled program of the full ones. A batch holds one
    task at one context length, so its rows share a length bucket and run as one batch; were they to
    span buckets, the engine would split the batch by bucket and the copies would join the last
    row's sub-batch (answers unchanged).
    min_new_tokens: every batch's decode loop is compiled for at least this many tokens
    (`kvjax.generate`'s `decode_tokens`), so tasks with different caps share one compiled loop; it
    stops at the batch's largest task cap, and each answer is cut to its own task's cap (greedy
    decoding makes that the answer a run with the smaller cap would give).
    The returned function's `share_shapes(samples, query_aware)` pads every later batch's questions
    to the longest question among `samples`, so that tasks share one compiled program (a task with
    long questions, such as niah_multikey_3's UUID keys, would otherwise compile every setting again).
    cache_layout: the decode cache layout (`kvjax.generate`'s; "ragged" stores only kept entries).
    """
    check_cache_layout(cache_layout)
    tokenizer = model.tokenizer
    shapes = {"question_tokens": 0}
    if tokenizer is None:
        raise ValueError(f"the model at {model.path} has no tokenizer: only the fidelity task can run on it")

    def _outputs(out, samples, contexts, questions) -> list[dict[str, Any]]:
        rows = []
        for b, s in enumerate(samples):  # each row cut to its own task's cap (greedy: a prefix of the longer run)
            n = min(int(out.lengths[b]), int(s["max_new_tokens"]))
            rows.append({"text": tokenizer.decode(out.tokens[b, :n].tolist(), skip_special_tokens=True),
                         "kept": float(out.kept[b]), "generated_tokens": n,
                         "prompt_tokens": len(contexts[b]) + len(questions[b]),
                         "batch_cache_bytes": int(out.cache_bytes), **cache_stats(out, b)})
        return rows

    def _inputs(samples, query_aware):
        contexts, questions = _split_ids(samples, tokenizer, query_aware)
        extra = max(0, (pad_to or 0) - len(samples))
        # one compiled decode loop for every task (decode_tokens), stopping at this batch's own cap
        cap = max(s["max_new_tokens"] for s in samples)
        return contexts, questions, dict(prompts=contexts + contexts[-1:] * extra,
                                         questions=questions + questions[-1:] * extra, max_new_tokens=cap,
                                         decode_tokens=max(min_new_tokens, cap),
                                         question_tokens=shapes["question_tokens"])

    def share_shapes(samples: list[dict[str, Any]], query_aware: bool) -> None:
        _, questions = _split_ids(samples, tokenizer, query_aware)
        shapes["question_tokens"] = max([len(q) for q in questions], default=0)

    def generate_fn(samples: list[dict[str, Any]], *, policy: str | None, compression_ratio: float | None,
                    budget: int | None, query_aware: bool, prefill_chunk: int | None = None,
                    kv_quant: Any = None) -> list[dict[str, Any]]:
        contexts, questions, kw = _inputs(samples, query_aware)
        out = engine.generate(model, kw.pop("prompts"), policy=policy, compression_ratio=compression_ratio, budget=budget,
                              prefill_chunk=prefill_chunk, cache_layout=cache_layout, kv_quant=kv_quant, **kw)
        return _outputs(out, samples, contexts, questions)

    def many(samples: list[dict[str, Any]], *, settings, query_aware: bool) -> list[list[dict[str, Any]]]:
        """All `settings` (runner Settings) on one batch, sharing the model prefill. A setting the
        policy rejects for these prompts (e.g. a budget below its protected window) gets the error."""
        contexts, questions, kw = _inputs(samples, query_aware)
        outs = engine.generate_settings(model, kw.pop("prompts"), list(settings), on_error="return",
                                        cache_layout=cache_layout, **kw)
        return [out if isinstance(out, Exception) else _outputs(out, samples, contexts, questions) for out in outs]

    generate_fn.many = many
    generate_fn.share_shapes = share_shapes
    return generate_fn


def make_logits_fn(model: Any):
    """A runner ``logits_fn`` over `kvjax.engine.continuation_logits` (teacher-forced continuation logits)."""

    def logits_fn(samples: list[dict[str, Any]], *, policy: str | None, compression_ratio: float | None,
                  budget: int | None, prefill_chunk: int | None = None) -> list[Any]:
        contexts = [s["metadata"]["context_ids"] for s in samples]
        continuations = [s["metadata"]["continuation_ids"] for s in samples]
        return engine.continuation_logits(model, contexts, continuations, policy=policy,
                                   compression_ratio=compression_ratio, budget=budget, prefill_chunk=prefill_chunk)

    return logits_fn
