"""Prompt sources and the grain input pipeline.

Prompt sources are grain random-access sources of records {"id", "prompt" | "messages" | "tokens"} and, for
`targets.teacher: answer`, the reference answer {"answer" | "answer_tokens"}:

- `SyntheticPrompts`: the project's synthetic long-context generators (kvjax.data), with
  seeds offset by `SEED_OFFSET` so that no training prompt is an evaluation prompt;
- `FilePrompts`: local JSONL or Parquet rows;
- `HFPrompts`: a Hugging Face dataset (online; `datasets` is imported only when used).

`train_dataset` is the training pipeline over the target records: shuffled by seed, repeated,
sliced per process, batched; its iterator's `get_state()` is stored with every checkpoint so a
resumed run reads exactly the batches an uninterrupted run would have read.
"""

from __future__ import annotations

import bisect
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from kvjax.data import generate, resolve_tasks
from kvjax.data.base import encode, reference_answer
from kvjax.data.prompts import build_prompt
from kvjax.lookahead import PROMPT_CACHE_GLOBAL, PROMPT_CACHE_LOCAL

from train_lookahead.config import DataSection, SourceSection

# The eval draws samples with small seeds (42 by default) and sample indices < 1_000_003; the bundled
# model trained on seed 1_000_003. Training prompts use seeds >= 2 * 10**6: no seed is shared.
SEED_OFFSET = 2 * 10**6
MAX_PER_SEED = 10**6  # synthetic samples per task and source seed (seeds of different sources never meet)

PROMPT_FIELDS = ("prompt", "messages", "tokens")
ANSWER_FIELDS = ("answer", "answer_tokens")  # optional: the reference answer (text or ids) after the prompt
# the axis of each training batch array that holds its rows (split over the "data" mesh axis by
# kvjax.training's loop): target is [L, B, Hq, T], every other array [B, ...]
ROW_AXES = {"target": 1, **{k: 1 for k in PROMPT_CACHE_GLOBAL + PROMPT_CACHE_LOCAL}}


def synthetic_seed(source_seed: int, k: int) -> int:
    """The kvjax.data seed of the k-th training sample of a task in a source with `source_seed`."""
    if not 0 <= k < MAX_PER_SEED:
        raise ValueError(f"synthetic sample index {k} out of range [0, {MAX_PER_SEED})")
    return SEED_OFFSET + source_seed * MAX_PER_SEED + k


class SyntheticPrompts:
    """`num_samples` prompts of the synthetic tasks, task by task in turn; item i is generated on
    demand with seed `synthetic_seed(seed, i // len(tasks))`. Items are rendered as kvjax.eval renders
    them: query-aware full prompts (context + question + answer prefix), or with `query_aware: false` the
    part the question-agnostic protocol compresses (the context, without the question)."""

    def __init__(self, source: SourceSection, tokenizer: Any):
        if tokenizer is None:
            raise ValueError("a synthetic source needs a model with a tokenizer; for token-id models use a "
                             "jsonl source with a 'tokens' field")
        self.tasks = resolve_tasks(list(source.tasks))
        self.source, self.tokenizer = source, tokenizer
        if source.num_samples // len(self.tasks) >= MAX_PER_SEED:
            raise ValueError(f"data.sources[].num_samples={source.num_samples} is too large (at most "
                             f"{MAX_PER_SEED} per task)")

    def __len__(self) -> int:
        return self.source.num_samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        task = self.tasks[i % len(self.tasks)]
        seed = synthetic_seed(self.source.seed, i // len(self.tasks))
        (sample,) = generate(task, self.tokenizer, self.source.context_length, 1, seed=seed)
        parts = build_prompt(sample, self.tokenizer, query_aware=self.source.query_aware)
        text = parts.text if self.source.query_aware else parts.compressed
        record = {"id": f"{task}/seed{seed}", "text": text,
                  "context_tokens": context_tokens(encode(self.tokenizer, text), sample, self.tokenizer)}
        if self.source.query_aware:  # the answer follows the question (targets.teacher: answer)
            record["answer"] = reference_answer(sample)
        return record


def context_tokens(ids: list[int], sample: dict[str, Any], tokenizer: Any) -> int:
    """How many leading tokens of a rendered prompt `ids` are its context: the part the question-agnostic
    protocol compresses (`build_prompt(..., query_aware=False).compressed`), up to where the two
    tokenisations first differ (a merge across the context's end)."""
    head = encode(tokenizer, build_prompt(sample, tokenizer, query_aware=False).compressed)
    n = 0
    while n < min(len(head), len(ids)) and head[n] == ids[n]:
        n += 1
    return n


class FilePrompts:
    """Rows of a local JSONL (.jsonl / .json lines) or Parquet file, each with a "prompt" (text),
    "messages" (a list of {"role", "content"}) or "tokens" (a list of ids) field."""

    def __init__(self, source: SourceSection):
        path = pathlib.Path(source.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data.sources[].path {str(path)!r}: no such file")
        rows = _read_parquet(path) if source.kind == "parquet" else _read_jsonl(path)
        self.rows = [_check_row(r, f"{path}:{i + 1}") for i, r in enumerate(rows)]
        if source.num_samples is not None:
            if source.num_samples > len(self.rows):
                raise ValueError(f"data.sources[].num_samples={source.num_samples} but {path} has "
                                 f"{len(self.rows)} rows")
            self.rows = self.rows[: source.num_samples]
        self.name = path.name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": f"{self.name}/{i}", **self.rows[i]}


class HFPrompts(FilePrompts):
    """A Hugging Face dataset split (needs `datasets` and the network, or its local cache)."""

    def __init__(self, source: SourceSection):
        try:
            import datasets
        except ImportError:
            raise ImportError("an hf data source needs the `datasets` package (pip install datasets)") from None
        try:
            ds = datasets.load_dataset(source.name, source.subset, split=source.split)
        except Exception as e:
            raise RuntimeError(f"Hugging Face dataset {source.name!r} (subset {source.subset!r}, split "
                               f"{source.split!r}) could not be loaded; offline? Use a jsonl or parquet source "
                               f"with a local copy instead ({type(e).__name__}: {e})") from None
        n = len(ds) if source.num_samples is None else min(source.num_samples, len(ds))
        self.rows = [_check_row(dict(ds[i]), f"{source.name}[{i}]") for i in range(n)]
        self.name = source.name


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    return rows


def _read_parquet(path: pathlib.Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("parquet sources need pyarrow (pip install pyarrow)") from None
    return pq.read_table(path).to_pylist()


def _check_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with one of the fields {PROMPT_FIELDS}, "
                         f"got {type(row).__name__}")
    present = [f for f in PROMPT_FIELDS if row.get(f) is not None]
    if len(present) != 1:
        raise ValueError(f"{where}: a row needs exactly one of the fields {', '.join(PROMPT_FIELDS)}; "
                         f"found {present or 'none'} among {sorted(row)}")
    out = {present[0]: row[present[0]]}
    for field in ANSWER_FIELDS:  # a reference answer, for targets.teacher: answer
        if row.get(field) is not None:
            out[field] = row[field]
    return out


class ConcatSource:
    """Several random-access sources one after another."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = list(sources)
        self.offsets = np.cumsum([0] + [len(s) for s in self.sources]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = bisect.bisect_right(self.offsets, i) - 1
        return self.sources[j][i - self.offsets[j]]


def make_source(source: SourceSection, tokenizer: Any) -> Any:
    if source.kind == "synthetic":
        return SyntheticPrompts(source, tokenizer)
    if source.kind == "hf":
        return HFPrompts(source)
    return FilePrompts(source)


def encode_record(record: dict[str, Any], tokenizer: Any, chat_template: bool) -> list[int]:
    """Token ids of one prompt record: ids as given; chat messages (or, with `chat_template`,
    prompt text) through the tokenizer's chat template with the generation prompt; plain text
    as BOS + text. Special tokens are never added twice."""
    if "tokens" in record:
        ids = record["tokens"]
        if not all(isinstance(t, (int, np.integer)) for t in ids):
            raise ValueError(f"{record['id']}: 'tokens' must be a list of ints")
        return [int(t) for t in ids]
    if tokenizer is None:
        raise ValueError(f"{record['id']}: text prompts need a model with a tokenizer (give 'tokens' instead)")
    if "text" in record:  # already rendered (synthetic)
        return encode(tokenizer, record["text"])
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if "messages" in record or (chat_template and has_template):
        if not has_template:
            raise ValueError(f"{record['id']}: 'messages' need a tokenizer with a chat template")
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return encode(tokenizer, text)
    return encode(tokenizer, (getattr(tokenizer, "bos_token", None) or "") + record["prompt"])


def prompt_source(data: DataSection, tokenizer: Any) -> ConcatSource:
    """All configured prompt sources, in the order the config lists them."""
    return ConcatSource([make_source(s, tokenizer) for s in data.sources])


def prompt_dataset(data: DataSection, tokenizer: Any) -> grain.MapDataset:
    """The prompts as a grain MapDataset of {"id", "tokens"} (deterministic, random access)."""
    return grain.MapDataset.source(prompt_source(data, tokenizer)).map(
        lambda r: {"id": r["id"], "tokens": encode_record(r, tokenizer, data.chat_template)})


def to_example(record: dict[str, np.ndarray], max_prompt_tokens: int,
               max_response_tokens: int | None = None, query_aware: bool = True) -> dict[str, np.ndarray]:
    """One target record -> fixed-shape arrays: tokens [T] (pad 0), positions [T] (-1 = pad), and
    target [L, Hq, T] float32 (0 on padding), or for an on-the-fly record response [Y] (pad 0) and
    response_positions [Y] (continuing the prompt's positions; -1 = pad); a stored prompt cache's arrays
    pass through, prompt_k / prompt_v padded to [L, Hkv, T, D] with empty slots.
    query_aware False (stored targets): the prompt is cut to its first record["context_tokens"] tokens,
    the target and the stored cache with it (a causal prefill's first slots are the context's own)."""
    if not query_aware:
        if "target" not in record or record.get("context_tokens") is None:
            raise ValueError("train.query_aware: false needs stored targets whose records know their context "
                             "(synthetic sources; targets written or backfilled with context_lengths)")
        c = int(record["context_tokens"])
        record = {**record, "tokens": record["tokens"][:c], "target": record["target"][..., :c],
                  **{k: record[k][:, :, :c] for k in PROMPT_CACHE_GLOBAL if k in record}}
    n = len(record["tokens"])
    if n > max_prompt_tokens:
        raise ValueError(f"a target record has {n} prompt tokens > data.max_prompt_tokens={max_prompt_tokens}; "
                         "regenerate the targets with this config")
    tokens = np.zeros(max_prompt_tokens, np.int32)
    tokens[:n] = record["tokens"]
    positions = np.where(np.arange(max_prompt_tokens) < n, np.arange(max_prompt_tokens), -1).astype(np.int32)
    out = {"tokens": tokens, "positions": positions}
    if "target" in record:
        target = np.zeros(record["target"].shape[:2] + (max_prompt_tokens,), np.float32)
        target[..., :n] = record["target"][..., :n]
        out["target"] = target
        for k in PROMPT_CACHE_GLOBAL:  # a stored prompt cache [L, Hkv, n, D]: slots past the prompt are empty
            if k in record:
                a = record[k]
                out[k] = np.zeros(a.shape[:2] + (max_prompt_tokens,) + a.shape[3:], a.dtype)
                out[k][:, :, :n] = a[:, :, :n]
        out.update({k: np.asarray(record[k]) for k in PROMPT_CACHE_LOCAL if k in record})
    else:
        m, Y = len(record["response"]), max_response_tokens
        if Y is None or m > Y:
            raise ValueError(f"a response of {m} tokens does not fit targets.max_response_tokens={Y}")
        out["response"] = np.zeros(Y, np.int32)
        out["response"][:m] = record["response"]
        out["response_positions"] = np.where(np.arange(Y) < m, n + np.arange(Y), -1).astype(np.int32)
    return out


def _layers_first(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """target [B, L, Hq, T] -> [L, B, Hq, T], and a stored prompt cache's arrays [B, L, ...] -> [L, B, ...]:
    the layout of kvjax.lookahead.loss_fn."""
    return {k: np.ascontiguousarray(np.swapaxes(a, 0, 1)) if k in ROW_AXES else a for k, a in batch.items()}


def train_dataset(records: Any, *, batch_size: int, seed: int, max_prompt_tokens: int,
                  max_response_tokens: int | None = None, process_index: int = 0,
                  process_count: int = 1, query_aware: bool = True) -> grain.IterDataset:
    """Endless batches of this process's rows: {"tokens" [b, T], "positions" [b, T], and "target"
    [L, b, Hq, T] or "response" / "response_positions" [b, Y]} with b = batch_size // process_count.
    Every epoch is a fresh permutation of `records` under `seed`."""
    if batch_size % process_count:
        raise ValueError(f"train.batch_size={batch_size} must be divisible by the {process_count} processes")
    if len(records) < batch_size:
        raise ValueError(f"{len(records)} target records are fewer than train.batch_size={batch_size}")
    ds = grain.MapDataset.source(records).shuffle(seed=seed).repeat(None)
    ds = ds[process_index::process_count].map(lambda r: to_example(r, max_prompt_tokens, max_response_tokens,
                                                                 query_aware))
    ds = ds.batch(batch_size // process_count, drop_remainder=True).map(_layers_first)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
