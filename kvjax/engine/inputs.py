"""Host-side inputs of the engine: prompt encoding and validation, length buckets, padding, and
the split of a batch into sub-batches by bucket.

Prompts are right-padded to a length bucket; row b's prompt sits at positions 0..len_b-1 and
padding is marked by position -1. Buckets bound the number of compiled shapes. A batch whose
prompts fall in several buckets runs as sub-batches, each padded only to its own bucket
(`split_rows`), so that a short prompt never pays for the longest one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.model import Model
from kvjax.policies.base import PromptFormat
from kvjax.sampling import Sampler
from kvjax.sharding import logical_sharding

BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MIN_QUESTION_BUCKET = 64
# max_new_tokens is rounded up to one of these for the compiled shapes (the loop stops at the real limit)
STEP_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def bucket_length(n: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket >= n (multiples of the largest bucket beyond it)."""
    for b in buckets:
        if b >= n:
            return b
    top = buckets[-1]
    return -(-n // top) * top


def encode_prompts(model: Model, prompts: Any, *, chat_template: bool = False, what: str = "prompts") -> list[list[int]]:
    """Strings (tokenized, optionally chat-templated) or token-id sequences -> lists of ids."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray) or len(prompts) == 0:
        raise ValueError(f"{what} must be a non-empty list of strings or of token-id sequences")
    vocab = model.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise ValueError(f"{what}[{i}] is a string, but the model at {model.path} has no tokenizer: pass token ids")
            if chat_template:
                ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tok(p)["input_ids"]
        else:
            if chat_template:
                raise ValueError("chat_template=True needs string prompts, not token ids")
            arr = np.asarray(p)
            if arr.size == 0:
                raise ValueError(f"{what}[{i}] is empty")
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"{what}[{i}] must be a string or a 1-D sequence of int token ids, got {arr.dtype} {arr.shape}")
            ids = arr.tolist()
        if len(ids) == 0:
            raise ValueError(f"{what}[{i}] is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what}[{i}] has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        out.append(list(ids))
    return out


def chat_template_parts(tokenizer: Any) -> tuple[str, str] | None:
    """The chat template's text before and after a user turn's content, found as kvpress 0.5.5 does
    (`KVzipPress.__call__`): one user turn "dummy context" + "\\n" + "#" * 13 rendered with the
    generation prompt (enable_thinking=False), cut at the "\\n###..." separator and at the content.
    None when the tokenizer has no chat template (or one that rewrites the content)."""
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        return None
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
    except Exception:  # a template that refuses a lone user turn (jinja raises its own errors): unknown parts
        return None
    if text.count(separator) != 1 or dummy not in text.split(separator)[0]:
        return None  # a template that rewrites the turn's content: its parts are unknown
    head, suffix = text.split(separator)
    return head.split(dummy)[0], suffix


def prompt_format(model: Model, rows: list[list[int]]) -> PromptFormat | None:
    """What the engine knows of how `rows` were written (`kvjax.policies.base.PromptFormat`), from the
    model's tokenizer: None without a tokenizer or a chat template; else the template's prefix and suffix
    ids (`chat_template_parts`, encoded without special tokens, as kvpress does) and, per row, whether it
    starts with the prefix ids and goes on after them (chat-templated: `generate(..., chat_template=True)`,
    or ids the caller rendered with the template, as the eval does)."""
    tok = model.tokenizer
    parts = chat_template_parts(tok)
    if parts is None:
        return None

    def encode(text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in tok.encode(text, add_special_tokens=False))

    prefix, suffix = (encode(t) for t in parts)
    n = len(prefix)
    templated = tuple(n > 0 and len(r) > n and tuple(int(t) for t in r[:n]) == prefix for r in rows)
    return PromptFormat(prefix_ids=prefix, suffix_ids=suffix, templated=templated, encode=encode)


def pad_rows(rows: list[list[int]], length: int, pad_id: int, offsets: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads to `length`: tokens [B, length] and positions [B, length] (-1 on padding).

    offsets [B]: the position of each row's first token (a chunk fed after a prompt), default 0.
    """
    tokens = np.full((len(rows), length), pad_id, np.int32)
    positions = np.full((len(rows), length), -1, np.int32)
    for b, r in enumerate(rows):
        start = 0 if offsets is None else int(offsets[b])
        tokens[b, : len(r)] = r
        positions[b, : len(r)] = np.arange(start, start + len(r))
    return tokens, positions


def chunk_rows(rows: list[list[int]], chunk: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts cut into chunks of `chunk` tokens for a chunked prefill, aligned on each prompt's
    end: tokens, positions [K, B, chunk] with K = max ceil(len_b / chunk) chunks.

    Row b's last chunk (index K - 1, for every row) holds its last `chunk` tokens, the one before
    the `chunk` before those, and its first chunk the remainder (1..chunk tokens); the chunks before
    that are empty (positions -1). Within a chunk the real tokens come first (right padding), so
    every chunk but a row's first is full, and the policy's final decision sees a full window.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    K = max(-(-len(r) // chunk) for r in rows)
    tokens = np.full((K, len(rows), chunk), pad_id, np.int32)
    positions = np.full((K, len(rows), chunk), -1, np.int32)
    for b, r in enumerate(rows):
        T = len(r)
        for c in range(K - (-(-T // chunk)), K):
            end = T - (K - 1 - c) * chunk
            start = max(0, end - chunk)
            tokens[c, b, : end - start] = r[start:end]
            positions[c, b, : end - start] = np.arange(start, end)
    return tokens, positions


def put_batch(mesh: jax.sharding.Mesh | None, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
    """Host arrays -> device arrays, the batch axis sharded over `data` when a mesh is given."""
    if mesh is None:
        return tuple(jnp.asarray(a) for a in arrays)
    return tuple(jax.device_put(a, logical_sharding(("batch",) + (None,) * (a.ndim - 1), a.shape, mesh)) for a in arrays)


@dataclasses.dataclass
class Batch:
    """A validated, encoded batch (host side) and its bucketed shapes.

    rows / q_rows: token ids of the prompts (contexts) and of their questions (None without);
    lengths / q_lengths [B]; bucket / q_bucket: padded lengths; steps: the decode-loop bucket;
    buckets / question_tokens: the rules that gave bucket and q_bucket (a sub-batch reapplies them).
    """

    rows: list[list[int]]
    q_rows: list[list[int]] | None
    lengths: np.ndarray
    q_lengths: np.ndarray
    bucket: int
    q_bucket: int
    steps: int
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    sampler: Sampler
    buckets: tuple[int, ...] = BUCKETS
    question_tokens: int = 0
    decode_tokens: int = 0

    @classmethod
    def build(cls, rows: list[list[int]], q_rows: list[list[int]] | None, *, buckets: Sequence[int],
              question_tokens: int, max_new_tokens: int, decode_tokens: int = 0, **rest: Any) -> Batch:
        """The batch of `rows` (and `q_rows`) with its lengths and buckets worked out; the decode loop
        is compiled for max(max_new_tokens, decode_tokens) tokens and stops at max_new_tokens. `rest`:
        stop_ids, pad_id, sampler."""
        B = len(rows)
        lengths = np.array([len(r) for r in rows], np.int32)
        q_lengths = np.array([len(r) for r in q_rows], np.int32) if q_rows else np.zeros(B, np.int32)
        q_bucket = 0
        if q_rows:  # questions are short and vary by task: one floor bucket lets tasks share compiled programs
            floor = [b for b in buckets if b >= MIN_QUESTION_BUCKET] or buckets
            q_bucket = bucket_length(max(int(q_lengths.max()), int(question_tokens)), floor)
        return cls(rows=rows, q_rows=q_rows, lengths=lengths, q_lengths=q_lengths,
                   bucket=bucket_length(int(lengths.max()), buckets), q_bucket=q_bucket,
                   steps=bucket_length(max(int(max_new_tokens), int(decode_tokens)), STEP_BUCKETS),
                   max_new_tokens=int(max_new_tokens), buckets=tuple(buckets), question_tokens=int(question_tokens),
                   decode_tokens=int(decode_tokens), **rest)

    def take(self, index: np.ndarray) -> Batch:
        """The sub-batch of rows `index` [b] (repeats allowed), padded to its own buckets."""
        pick = [int(i) for i in index]
        q_rows = None if self.q_rows is None else [self.q_rows[i] for i in pick]
        return Batch.build([self.rows[i] for i in pick], q_rows, buckets=self.buckets,
                           question_tokens=self.question_tokens, max_new_tokens=self.max_new_tokens,
                           decode_tokens=self.decode_tokens, stop_ids=self.stop_ids, pad_id=self.pad_id, sampler=self.sampler)

    @property
    def room(self) -> int:
        """Slots per head needed after the prompt: the questions and every decoded token."""
        return self.q_bucket + self.steps

    def prompt_arrays(self, mesh) -> tuple[jax.Array, jax.Array]:
        """Device tokens and positions [B, bucket]."""
        return put_batch(mesh, *pad_rows(self.rows, self.bucket, self.pad_id))

    def question_arrays(self, mesh) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Device question tokens and positions [B, q_bucket] (after each prompt) and the index of
        each row's last question token [B, 1]."""
        tokens, positions = pad_rows(self.q_rows, self.q_bucket, self.pad_id, offsets=self.lengths)
        return put_batch(mesh, tokens, positions, (self.q_lengths - 1)[:, None])


SPLITS = ("bucket", None)


def split_rows(lengths: np.ndarray, buckets: Sequence[int] = BUCKETS, split: str | None = "bucket",
               multiple: int = 1) -> list[np.ndarray]:
    """The row indices [b] of each sub-batch that a batch of prompt `lengths` [B] runs as.

    split=None, or rows that all fall in one length bucket: one batch, all rows in order (as ever).
    split="bucket": rows are grouped by their bucket (shortest bucket first, the caller's order
    within a group), and each group runs as sub-batches of `multiple` x a power of two rows, the
    group's binary decomposition (7 rows: 4 + 2 + 1), so that no row is padded beyond its own bucket
    and a bucket compiles at most log2(B) + 1 batch sizes, whatever the mix of lengths. A group is
    first topped up to a multiple of `multiple` (the mesh's data axis) with copies of its last row,
    whose outputs the caller drops.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    row_buckets = np.array([bucket_length(int(n), buckets) for n in lengths])
    if split is None or len(set(row_buckets.tolist())) == 1:
        return [np.arange(len(lengths))]
    parts = []
    for bucket in sorted(set(row_buckets.tolist())):
        group = np.flatnonzero(row_buckets == bucket)
        group = np.concatenate([group, np.repeat(group[-1:], -len(group) % multiple)])
        parts += power_of_two_chunks(group, multiple)
    return parts


def power_of_two_chunks(index: np.ndarray, multiple: int = 1) -> list[np.ndarray]:
    """index [n] (n a multiple of `multiple`) cut into chunks of `multiple` x 2^k rows, largest first."""
    units, out, start = len(index) // multiple, [], 0
    for k in reversed(range(units.bit_length())):
        if units >> k & 1:
            size = multiple << k
            out.append(index[start:start + size])
            start += size
    return out


def prepare(model: Model, prompts: Any, *, questions: Any = None, max_new_tokens: int = 64,
            temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
            stop_tokens: Sequence[int] | None = None, chat_template: bool = False,
            buckets: Sequence[int] = BUCKETS, question_tokens: int = 0, decode_tokens: int = 0) -> Batch:
    """Validates and encodes a generation request (see `kvjax.generate` for the arguments)."""
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if not isinstance(decode_tokens, (int, np.integer)) or decode_tokens < 0:
        raise ValueError(f"decode_tokens={decode_tokens!r} must be an int >= 0")
    sampler = Sampler(float(temperature), top_k, top_p)
    rows = encode_prompts(model, prompts, chat_template=chat_template)
    q_rows = None
    if questions is not None:
        q_rows = encode_prompts(model, questions, what="questions")
        if len(q_rows) != len(rows):
            raise ValueError(f"got {len(rows)} prompts but {len(q_rows)} questions: give one question per context")
    batch = Batch.build(rows, q_rows, buckets=buckets, question_tokens=question_tokens, max_new_tokens=max_new_tokens,
                        decode_tokens=decode_tokens, stop_ids=stop_ids(model, stop_tokens), pad_id=pad_id(model), sampler=sampler)
    check_positions(model, int((batch.lengths + batch.q_lengths).max()), int(max_new_tokens))
    return batch


def stop_ids(model: Model, stop_tokens: Sequence[int] | None) -> tuple[int, ...]:
    """The ids that end a row: `stop_tokens`, or by default the model's (and its tokenizer's) EOS ids."""
    if stop_tokens is not None:
        return tuple(sorted({int(t) for t in stop_tokens}))
    stop = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        stop.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(stop))


def pad_id(model: Model) -> int:
    return model.config.pad_token_id if model.config.pad_token_id is not None else 0


def check_positions(model: Model, prompt_tokens: int, new_tokens: int, what: str = "max_new_tokens") -> None:
    """Refuses sequences longer than the model's positions (nothing is silently truncated)."""
    cfg = model.config
    total = prompt_tokens + new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"the longest prompt ({prompt_tokens} tokens) plus {what}={new_tokens} needs {total} positions, "
            f"more than the model allows (max_position_embeddings={cfg.max_position_embeddings})")
    if cfg.sliding_window is not None and not cfg.local_layer_ids and total > cfg.sliding_window:
        raise ValueError(f"sequences of {total} tokens exceed the sliding_window={cfg.sliding_window} of this "
                         "checkpoint, which kvjax does not implement")
