"""Target generation: the frozen model's greedy response to each prompt, and its mean
response->prompt attention per layer and query head (policies.md §11.1, s_GT).

Prompts are taken `targets.batch_size` at a time (source indices [i*b, (i+1)*b) form chunk i).
Each chunk is written to `<workdir>/targets/chunk_<i>/` through a temporary folder renamed when
complete, so a killed run re-run skips the finished chunks and redoes at most one. The prompt
cache is prefilled once; the response runs against it as a continuation in chunks
(kvjax.lookahead.response_attention), so no [T+Y]^2 matrix exists.

A chunk folder holds tokens [n, Tc] int32 (right-padded with 0), lengths [n], target
[n, L, Hq, Tc] (L = the model's global layers; zero past each row's length), response [n, Y] and
response_lengths [n], ids.json; with `targets.prompt_cache` also the frozen prefill's cache per prompt
(`kvjax.lookahead.split_prompt_cache`, the batch axis first): prompt_k, prompt_v [n, L, Hkv, Tc, D] in the
model's dtype (and a sliding-window model's rolling buffers, prompt_local_*), so that training need not
prefill the prompts again; for synthetic prompts also context_lengths [n] (the tokens of each prompt's
context, the question-agnostic compressed part; `train.query_aware: false` trains on it alone).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

import kvjax
from kvjax.data.base import encode
from kvjax.lookahead import PROMPT_CACHE_GLOBAL, PROMPT_CACHE_LOCAL, prompt_cache, response_attention, split_prompt_cache
from kvjax.models.config import ModelConfig
from kvjax.passes.reconstruction import Reconstruction, reconstruction_scores

from train_lookahead.config import DataSection, TargetsSection
from train_lookahead.data import encode_record, prompt_source

MANIFEST = "manifest.json"
CONTEXT_LENGTHS = "context_lengths"  # per record: its context's tokens (the question-agnostic compressed part)


# the `kvzip` preset's reconstruction pass (kvjax.policies.kvzip.KVzip's defaults): the teacher "kvzip"
KVZIP_PASS = Reconstruction()


@functools.partial(jax.jit, static_argnames=("cfg", "with_cache"))
def _kvzip_targets(params: Any, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                   with_cache: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KVzip's scores as a target [L, B, Hq, T] (each KV head's score repeated over its query heads) for
    prompts tokens/positions [B, T], and with `with_cache` the prompt cache's arrays."""
    cache = prompt_cache(params, cfg, tokens, positions)
    scores = reconstruction_scores(params, cfg, cache, tokens, positions, KVZIP_PASS)  # [L, B, Hkv, T]
    target = jnp.repeat(scores, cfg.num_heads // cfg.num_kv_heads, axis=2)
    return target, (split_prompt_cache(cache) if with_cache else {})


@functools.partial(jax.jit, static_argnames=("cfg", "with_cache"))
def _targets(params: Any, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, response: jax.Array,
             response_positions: jax.Array, with_cache: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """s_GT [L, B, Hq, T] (L = cfg.num_global_layers) for prompts tokens/positions [B, T] and responses
    [B, Y] (-1 = pad), and with `with_cache` the prompt cache's arrays (`split_prompt_cache`; else {})."""
    B, T = tokens.shape
    cache = prompt_cache(params, cfg, tokens, positions)
    target = response_attention(params, cfg, cache, response, response_positions)[..., :T]
    return target, (split_prompt_cache(cache) if with_cache else {})


def chunk_targets(model: kvjax.Model, prompts: list[list[int]], *, max_prompt_tokens: int,
                  max_response_tokens: int, batch_size: int, attention: bool = True,
                  with_cache: bool = False, teacher: str = "response",
                  answers: list[list[int]] | None = None) -> dict[str, np.ndarray]:
    """Responses and s_GT for up to `batch_size` prompts (each at most `max_prompt_tokens` tokens).

    Rows are padded to `batch_size` with copies of the first prompt so every chunk has one shape.
    Returns tokens [n, Tc], lengths [n], target [n, L, Hq, Tc] float32 (only with `attention`),
    response [n, Y], response_lengths [n], and with `with_cache` (needs `attention`) the prompt cache's
    arrays, rows first: prompt_k, prompt_v [n, L, Hkv, Tc, D] (prompt_local_* [n, Ll, Hkv, W, ...]).
    teacher "kvzip": the target is KVzip's scores instead (`_kvzip_targets`); no response is generated
    and none is returned. teacher "answer": the response is not generated but given, `answers[b]` (the
    reference answer's token ids, cut to `max_response_tokens`), read by the frozen model as a continuation.
    """
    n = len(prompts)
    rows = prompts + [prompts[0]] * (batch_size - n)
    lengths = np.array([len(p) for p in rows], np.int32)
    T = max_prompt_tokens
    tokens = np.zeros((batch_size, T), np.int32)
    positions = np.full((batch_size, T), -1, np.int32)
    for b, p in enumerate(rows):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = np.arange(len(p))
    Tc = int(lengths[:n].max())
    if teacher == "kvzip":
        target, cache = jax.device_get(_kvzip_targets(model.params, model.config, tokens, positions,
                                                      with_cache=with_cache))
        return {"tokens": tokens[:n, :Tc], "lengths": lengths[:n], **_target_rows(target, cache, lengths, n, Tc)}
    Y = max_response_tokens
    response = np.zeros((batch_size, Y), np.int32)
    if teacher == "answer":
        if answers is None or len(answers) != n or not all(answers):
            raise ValueError("targets.teacher: answer needs a non-empty reference answer for every prompt")
        given = answers + [answers[0]] * (batch_size - n)
        response_lengths = np.array([min(len(a), Y) for a in given], np.int32)
        for b, a in enumerate(given):
            response[b, : response_lengths[b]] = a[:Y]
    else:
        out = kvjax.generate(model, rows, max_new_tokens=max_response_tokens)
        response[:, : out.tokens.shape[1]] = out.tokens[:, :Y]
        response_lengths = np.asarray(out.lengths)
    steps = np.arange(Y)[None, :]
    response_positions = np.where(steps < response_lengths[:, None], lengths[:, None] + steps, -1).astype(np.int32)
    response = np.where(response_positions >= 0, response, 0)
    out_arrays = {"tokens": tokens[:n, :Tc], "lengths": lengths[:n], "response": response[:n],
                  "response_lengths": response_lengths[:n].astype(np.int32)}
    if not attention:
        return out_arrays
    target, cache = jax.device_get(_targets(model.params, model.config, tokens, positions, response,
                                            response_positions, with_cache=with_cache))
    return {**out_arrays, **_target_rows(target, cache, lengths, n, Tc)}


def _target_rows(target: Any, cache: dict[str, Any], lengths: np.ndarray, n: int, Tc: int) -> dict[str, np.ndarray]:
    """target [L, B, Hq, T] and the cache's arrays (batch on axis 1) as the chunk's first n rows, rows
    first and cut to Tc slots: target [n, L, Hq, Tc] float32 (0 past each row's length), prompt_* ."""
    target = np.asarray(target).transpose(1, 0, 2, 3)[:n, ..., :Tc]
    target = np.where(np.arange(Tc) < lengths[:n, None, None, None], target, 0.0).astype(np.float32)
    rows = {name: np.swapaxes(np.asarray(a), 0, 1)[:n] for name, a in cache.items()}
    rows.update({name: rows[name][:, :, :, :Tc] for name in PROMPT_CACHE_GLOBAL if name in rows})
    return {"target": target, **rows}


def generate_targets(model: kvjax.Model, data: DataSection, targets: TargetsSection, workdir: str | os.PathLike, *,
                     progress: bool = True) -> pathlib.Path:
    """Writes every chunk not yet on disk, then the manifest; returns the targets folder."""
    folder = pathlib.Path(workdir) / "targets"
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"max_prompt_tokens": data.max_prompt_tokens, "max_response_tokens": targets.max_response_tokens,
                "batch_size": targets.batch_size, "mode": targets.mode,
                "sources": [_source_settings(s) for s in data.sources], "chat_template": data.chat_template,
                "model": model_info(model.config)}
    # settings added later are named only when not their default, so that older folders still resume
    if targets.prompt_cache:
        settings["prompt_cache"] = True
    if targets.teacher != "response":
        settings["teacher"] = targets.teacher
    _check_settings(folder, settings)
    source = prompt_source(data, model.tokenizer)
    if (folder / MANIFEST).exists():
        backfill_context_lengths(folder, source)
        return folder
    limit = _longest_prompt(model.config.max_position_embeddings, targets)
    n_chunks = -(-len(source) // targets.batch_size)
    # every process decides the same pending chunks before any is written (the model is sharded over
    # all of them, so they must run the same generate calls in the same order)
    pending = [i for i in range(n_chunks) if not (folder / f"chunk_{i:05d}").exists()]
    multihost_utils.sync_global_devices("train_lookahead: target plan")
    for i in tqdm(pending, desc="targets", disable=not progress):
        ids, prompts, contexts, answers = [], [], [], []
        for j in range(i * targets.batch_size, min(len(source), (i + 1) * targets.batch_size)):
            record = source[j]
            ids_j = encode_record(record, model.tokenizer, data.chat_template)
            if len(ids_j) > min(data.max_prompt_tokens, limit) or not ids_j:
                if data.long_prompts == "error":
                    raise ValueError(f"prompt {record['id']!r} has {len(ids_j)} tokens; data.max_prompt_tokens="
                                     f"{data.max_prompt_tokens} (and the model's positions allow {limit} before "
                                     f"the response). Raise the cap or set data.long_prompts: skip")
                continue
            ids.append(record["id"])
            prompts.append(ids_j)
            contexts.append(record.get("context_tokens"))
            if targets.teacher == "answer":
                answers.append(answer_ids(record, model.tokenizer))
        arrays = prompts and chunk_targets(
            model, prompts, max_prompt_tokens=data.max_prompt_tokens,
            max_response_tokens=targets.max_response_tokens, batch_size=targets.batch_size,
            attention=targets.mode == "stored", with_cache=targets.prompt_cache, teacher=targets.teacher,
            answers=answers if targets.teacher == "answer" else None)
        if arrays and all(c is not None for c in contexts):
            arrays[CONTEXT_LENGTHS] = np.array(contexts, np.int32)
        _write_chunk(folder / f"chunk_{i:05d}", ids, arrays, targets.dtype)
    multihost_utils.sync_global_devices("train_lookahead: targets written")
    counts = [_count(folder / f"chunk_{i:05d}") for i in range(n_chunks)]
    skipped = len(source) - sum(counts)
    manifest = {"chunks": counts, "records": sum(counts), "skipped_long": skipped, **settings}
    if sum(counts) == 0:
        raise ValueError(f"no prompt fits data.max_prompt_tokens={data.max_prompt_tokens}: every one was skipped")
    if jax.process_index() == 0:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    multihost_utils.sync_global_devices("train_lookahead: manifest written")
    return folder


def answer_ids(record: dict[str, Any], tokenizer: Any) -> list[int]:
    """The reference answer of a prompt record (its "answer" text, or "answer_tokens" ids), for `teacher: answer`."""
    if record.get("answer_tokens"):
        return [int(t) for t in record["answer_tokens"]]
    if not record.get("answer"):
        raise ValueError(f"{record['id']}: targets.teacher: answer needs each prompt's reference answer: synthetic "
                         "sources rendered query-aware (query_aware: true), or file rows with an 'answer' (text) or "
                         "'answer_tokens' (ids) field")
    if tokenizer is None:
        raise ValueError(f"{record['id']}: an 'answer' text needs a model with a tokenizer (give 'answer_tokens')")
    return encode(tokenizer, record["answer"])


def backfill_context_lengths(folder: pathlib.Path, source: Any) -> None:
    """Writes context_lengths.npy into finished chunks written before it existed, from the source's records
    (by id), when every record knows its context (synthetic sources); otherwise leaves the folder as it is."""
    chunks = [d for d in sorted(folder.glob("chunk_*")) if d.is_dir() and not d.name.endswith(".tmp")]
    missing = [d for d in chunks if _count(d) and not (d / f"{CONTEXT_LENGTHS}.npy").exists()]
    if not missing or jax.process_index() != 0:
        return
    known = {}
    for j in range(len(source)):
        record = source[j]
        if record.get("context_tokens") is None:
            return
        known[record["id"]] = record["context_tokens"]
    for d in missing:
        ids = json.loads((d / "ids.json").read_text())
        np.save(d / f"{CONTEXT_LENGTHS}.npy", np.array([known[i] for i in ids], np.int32))


def _longest_prompt(max_positions: int, targets: TargetsSection) -> int:
    """The longest prompt whose teacher pass fits the model's positions: the response's at most
    max_response_tokens, or KVzip's repeat of the prompt (T + min(T, chunk_size) + the instructions)."""
    if targets.teacher == "response":
        return max_positions - targets.max_response_tokens
    p = KVZIP_PASS
    extra = max(len(p.first_ids), len(p.next_ids) + p.postfix) + len(p.suffix_ids)
    one_chunk = min((max_positions - extra) // 2, p.chunk_size)  # T <= chunk_size: the pass repeats all T
    chunks = max_positions - extra - p.chunk_size  # T > chunk_size: a pass repeats chunk_size tokens
    return max(one_chunk, chunks if chunks > p.chunk_size else 0)


def _write_chunk(final: pathlib.Path, ids: list[str], arrays: dict[str, np.ndarray] | list, dtype: str) -> None:
    if jax.process_index() != 0:
        return
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, a in (arrays or {}).items():
        np.save(tmp / f"{name}.npy", a.astype(dtype) if name == "target" else a)
    (tmp / "ids.json").write_text(json.dumps(ids))
    os.replace(tmp, final)


def _count(chunk: pathlib.Path) -> int:
    return len(json.loads((chunk / "ids.json").read_text()))


def _check_settings(folder: pathlib.Path, settings: dict[str, Any]) -> None:
    """Targets written under other settings must not be mixed with these."""
    path = folder / "settings.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != json.loads(json.dumps(settings)):
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != json.loads(json.dumps(settings)).get(k))
            raise ValueError(f"{folder} holds targets made with other settings ({', '.join(diff)} differ); "
                             "use a new --workdir or delete that folder")
    elif jax.process_index() == 0:
        path.write_text(json.dumps(settings, indent=1))


def dataclass_dict(x: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(x)))


def _source_settings(source: Any) -> dict[str, Any]:
    d = dataclass_dict(source)
    if d.get("query_aware", True):  # the default, named only when off (older folders resume)
        d.pop("query_aware", None)
    return d


def model_info(cfg: ModelConfig) -> dict[str, int]:
    return {"layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}


class TargetRecords:
    """The finished targets folder as a grain random-access source of {"tokens" [T_i], and
    "target" [L, Hq, T_i] (mode "stored") or "response" [Y_i] (mode "on_the_fly")}, plus with a stored
    prompt cache its arrays: prompt_k, prompt_v [L, Hkv, T_i, D] (and prompt_local_* [Ll, Hkv, W, ...]), and
    "context_tokens" (an int) where the chunk stores context_lengths."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)
        path = self.folder / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"{self.folder} has no {MANIFEST}: the target stage has not finished")
        self.manifest = json.loads(path.read_text())
        self.chunks = [i for i, n in enumerate(self.manifest["chunks"]) if n]
        self.offsets = np.cumsum([0] + [self.manifest["chunks"][i] for i in self.chunks]).tolist()
        self.stored = self.manifest["mode"] == "stored"
        self.prompt_cache = bool(self.manifest.get("prompt_cache"))
        self._open: dict[int, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return self.offsets[-1]

    def _arrays(self, chunk: int) -> dict[str, np.ndarray]:
        if chunk not in self._open:
            d = self.folder / f"chunk_{chunk:05d}"
            names = ("tokens", "lengths") + (("target",) if self.stored else ("response", "response_lengths"))
            if self.prompt_cache:
                names += PROMPT_CACHE_GLOBAL + tuple(n for n in PROMPT_CACHE_LOCAL if (d / f"{n}.npy").exists())
            if (d / f"{CONTEXT_LENGTHS}.npy").exists():
                names += (CONTEXT_LENGTHS,)
            self._open[chunk] = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in names}
        return self._open[chunk]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self.offsets, i) - 1
        a = self._arrays(self.chunks[k])
        j = i - self.offsets[k]
        n = int(a["lengths"][j])
        if self.stored:
            cache = {k: np.asarray(a[k][j, :, :, :n] if k in PROMPT_CACHE_GLOBAL else a[k][j])
                     for k in a if k.startswith("prompt_")}
            context = {"context_tokens": int(a[CONTEXT_LENGTHS][j])} if CONTEXT_LENGTHS in a else {}
            return {"tokens": np.asarray(a["tokens"][j, :n]), "target": np.asarray(a["target"][j, ..., :n], np.float32),
                    **cache, **context}
        m = int(a["response_lengths"][j])
        return {"tokens": np.asarray(a["tokens"][j, :n]), "response": np.asarray(a["response"][j, :m])}
