"""The evaluation loop: settings x tasks x batches, scored and appended to a resumable JSONL.

A *setting* is the full cache (``policy=None``) or a policy at a compression ratio or a budget.
Every finished (task, policy, ratio/budget, sample id) is one line of ``results.jsonl``,
written as soon as its batch is done; a rerun reads the file and skips those entries.

The model is reached only through two injected callables, so that tests use fakes:

* ``generate_fn(samples, *, policy, compression_ratio, budget, query_aware) -> list``: one
  answer per sample, a string or a dict with ``text`` and optional statistics (kept entries,
  cache bytes, ...), stored under ``stats``. When it has a ``many(samples, *, settings,
  query_aware) -> list[list]`` attribute (one answer list per setting), the runner calls that
  once per batch for all pending settings, so a model can share work between them; a setting's
  entry may instead be an exception (the setting cannot run on these prompts, e.g. a budget below
  the policy's protected window): its rows are stored with ``score`` None and the ``error``;
* ``logits_fn(samples, *, policy, compression_ratio, budget) -> list[np.ndarray]`` for the
  fidelity task: per sample, the logits ``[T, V]`` predicting each continuation token after the
  context was (or was not, with ``policy=None``) compressed.

A setting with a quantized KV storage (``Setting.kv_quant``, `storage_name`) passes ``kv_quant`` to
``generate_fn`` too; every row records its storage (``kv_quant``: a preset name of
`kvjax.kv_quant.PRESETS`, or "none"; rows written before the field existed read as "none"). The
fidelity task teacher-forces through `kvjax.engine.continuation_logits`, which has no quantized path:
its quantized settings are recorded as not run, with the reason.
"""

from __future__ import annotations

import json
import pathlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvjax.engine import Setting
from kvjax.eval.metrics import kl_divergence, score_prediction, top1_agreement

GenerateFn = Callable[..., list[Any]]
LogitsFn = Callable[..., list[Any]]


def make_settings(policies: Sequence[str], compression_ratios: Sequence[float] = (),
                  budgets: Sequence[int] = (), baseline: bool = True,
                  prefill_chunk: int | None = None, kv_quant: Sequence[Any] = ("none",)) -> list[Setting]:
    """The full-cache baseline, then every policy at every ratio and every budget (each with a
    chunked prefill of `prefill_chunk` tokens when given; the baseline stays one-shot), each at every
    KV storage of `kv_quant` ("none" / None: the model dtype, or a preset name of
    `kvjax.kv_quant.PRESETS`): the baselines first, then per policy and storage its ratios, then
    its budgets."""
    storages = [None if q is None or q == "none" else q for q in kv_quant]
    if not storages:
        raise ValueError("kv_quant: give at least one storage ('none' for the model dtype)")
    out = [Setting(None, kv_quant=q) for q in storages] if baseline else []
    out += [Setting(p, compression_ratio=float(r), prefill_chunk=prefill_chunk, kv_quant=q)
            for p in policies for q in storages for r in compression_ratios]
    out += [Setting(p, budget=int(b), prefill_chunk=prefill_chunk, kv_quant=q)
            for p in policies for q in storages for b in budgets]
    return out


def storage_name(setting: Setting) -> str:
    """The setting's KV storage as rows record it: "none", or the preset name (`KVQuant.name`)."""
    return "none" if setting.kv_quant is None else setting.kv_quant.name


def row_key(task: str, setting_policy: str, setting_label: str, sample_id: str) -> tuple[str, str, str, str]:
    return task, setting_policy, setting_label, sample_id


class ResultStore:
    """``results.jsonl``: loaded once, appended and flushed line by line."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self.rows: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        if not self.path.exists():
            return
        bad = 0
        with self.path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interrupted run: recompute it
                    warnings.warn(f"{self.path}:{n}: unreadable line skipped (it will be recomputed)")
                    bad += 1
                    continue
                row.setdefault("kv_quant", "none")  # written before the storage axis: the model dtype
                self.rows[self.key(row)] = row
        if bad:  # rewrite without the broken lines, so that appends start on a clean line
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.rows.values()),
                           encoding="utf-8")
            tmp.replace(self.path)

    @staticmethod
    def key(row: dict[str, Any]) -> tuple[str, str, str, str]:
        return row_key(row["task"], row["policy"], row["setting"], row["sample_id"])

    def __contains__(self, key: tuple[str, str, str, str]) -> bool:
        return key in self.rows

    def add(self, rows: list[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                self.rows[self.key(row)] = row
            f.flush()


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start: start + size]


def _truncate_at_stop(text: str, stops: Sequence[str] | None) -> str:
    cut = len(text)
    for s in stops or ():
        j = text.find(s)
        if j >= 0:
            cut = min(cut, j)
    return text[:cut]


def _base_row(task: str, setting: Setting, sample: dict[str, Any], query_aware: bool) -> dict[str, Any]:
    row = {
        "task": task, "policy": setting.policy_name, "setting": setting.label,
        "compression_ratio": setting.compression_ratio, "budget": setting.budget,
        "kv_quant": storage_name(setting), "sample_id": sample["id"],
        "query_aware": query_aware, "length": sample.get("length"), "target_length": sample.get("target_length"),
    }
    meta = sample.get("metadata") or {}
    if "grid_length" in meta:  # needle-grid cell, for the heatmap
        row["grid"] = {"length": meta["grid_length"], "depth": meta["grid_depth"]}
    return row


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def run(
    samples_by_task: dict[str, list[dict[str, Any]]],
    settings: Sequence[Setting],
    out_dir: str | pathlib.Path,
    *,
    metrics: dict[str, str],
    generate_fn: GenerateFn | None = None,
    logits_fn: LogitsFn | None = None,
    query_aware: bool = False,
    batch_size: int = 8,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Runs every pending (task, setting, sample) and returns the rows of this run's keys, old and new.

    metrics: task -> metric name (``fidelity`` tasks use ``logits_fn``, the others ``generate_fn``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    missing = [t for t in samples_by_task if t not in metrics]
    if missing:
        raise ValueError(f"no metric given for task(s) {missing}")
    store = ResultStore(pathlib.Path(out_dir) / "results.jsonl")
    keys = [(task, st, s) for task, samples in samples_by_task.items() for st in settings for s in samples]
    pending = sum(row_key(t, st.policy_name, st.label, s["id"]) not in store for t, st, s in keys)
    from tqdm.auto import tqdm

    bar = tqdm(total=pending, desc="kvjax.eval", unit="sample", disable=not progress or pending == 0)
    try:
        for task, samples in samples_by_task.items():
            runner = _run_fidelity if metrics[task] == "fidelity" else _run_generation
            fn = logits_fn if metrics[task] == "fidelity" else generate_fn
            if fn is None and any(row_key(task, st.policy_name, st.label, s["id"]) not in store
                                  for st in settings for s in samples):
                kind = "logits_fn" if metrics[task] == "fidelity" else "generate_fn"
                raise ValueError(f"task {task} has pending work but no {kind} was given")
            for batch in _chunks(samples, batch_size):
                runner(task, batch, settings, store, fn, metrics[task], query_aware, bar)
    finally:
        bar.close()
    return [store.rows[row_key(t, st.policy_name, st.label, s["id"])] for t, st, s in keys]


def _run_generation(task: str, batch: list[dict[str, Any]], settings: Sequence[Setting], store: ResultStore,
                    generate_fn: GenerateFn, metric: str, query_aware: bool, bar) -> None:
    pending = {st: [s for s in batch if row_key(task, st.policy_name, st.label, s["id"]) not in store]
               for st in settings}
    pending = {st: todo for st, todo in pending.items() if todo}
    if not pending:
        return
    many = getattr(generate_fn, "many", None)
    if many is not None:  # one call for every setting: the model prefill is shared between them
        ids = {s["id"] for todo in pending.values() for s in todo}
        union = [s for s in batch if s["id"] in ids]
        bar.set_postfix_str(f"{task} x{len(pending)} settings")
        start = time.perf_counter()
        answers = many(union, settings=list(pending), query_aware=query_aware)
        seconds = (time.perf_counter() - start) / (len(union) * len(pending))
        if len(answers) != len(pending):
            raise ValueError(f"generate_fn.many returned {len(answers)} answer lists for {len(pending)} settings")
        for st, outs in zip(pending, answers):
            if isinstance(outs, Exception):  # the setting cannot run on these prompts: recorded, not scored
                warnings.warn(f"{task} {st.policy_name} {st.label}: not run ({outs})")
                store.add([{**_base_row(task, st, s, query_aware), "prediction": None, "answers": s["answers"],
                            "score": None, "metrics": {}, "stats": {}, "seconds": 0.0, "error": str(outs)}
                           for s in pending[st]])
                bar.update(len(pending[st]))
                continue
            by_id = dict(zip((s["id"] for s in union), _checked(outs, union)))
            _store_answers(task, st, pending[st], [by_id[s["id"]] for s in pending[st]], store, metric,
                           query_aware, seconds, bar)
        return
    for st, todo in pending.items():
        bar.set_postfix_str(f"{task} {st.policy_name} {st.label}")
        start = time.perf_counter()
        outputs = _checked(generate_fn(todo, query_aware=query_aware, **st.kwargs()), todo)
        _store_answers(task, st, todo, outputs, store, metric, query_aware,
                       (time.perf_counter() - start) / len(todo), bar)


def _checked(outputs: list[Any], samples: list[dict[str, Any]]) -> list[Any]:
    if len(outputs) != len(samples):
        raise ValueError(f"generate_fn returned {len(outputs)} answers for {len(samples)} samples")
    return outputs


def _store_answers(task: str, st: Setting, samples: list[dict[str, Any]], outputs: list[Any], store: ResultStore,
                   metric: str, query_aware: bool, seconds: float, bar) -> None:
    rows = []
    for sample, out in zip(samples, outputs):
        text = out["text"] if isinstance(out, dict) else out
        if not isinstance(text, str):
            raise TypeError(f"generate_fn must return strings or dicts with a 'text' string, got {type(text)}")
        stats = {k: _jsonable(v) for k, v in out.items() if k != "text"} if isinstance(out, dict) else {}
        prediction = _truncate_at_stop(text, sample.get("stop"))
        scored = score_prediction(metric, task, prediction, sample)
        rows.append({**_base_row(task, st, sample, query_aware), "prediction": prediction,
                     "answers": sample["answers"], "score": scored.pop("score"), "metrics": scored,
                     "stats": stats, "seconds": seconds})
    store.add(rows)
    bar.update(len(samples))


def _run_fidelity(task: str, batch: list[dict[str, Any]], settings: Sequence[Setting], store: ResultStore,
                  logits_fn: LogitsFn, metric: str, query_aware: bool, bar) -> None:
    todo = [st for st in settings
            if any(row_key(task, st.policy_name, st.label, s["id"]) not in store for s in batch)]
    if not todo:
        return
    quantized = [st for st in todo if st.kv_quant is not None]
    for st in quantized:  # no teacher-forced path through a quantized cache: recorded as not run, saying why
        why = ("the fidelity task teacher-forces its continuation through kvjax.engine.continuation_logits, "
               "which has no quantized KV storage: it runs at --kv-quant none only")
        warnings.warn(f"{task} {st.policy_name} {st.label}: not run ({why})")
        rows = [{**_base_row(task, st, s, query_aware), "prediction": None, "answers": [], "score": None,
                 "metrics": {}, "stats": {}, "seconds": 0.0, "error": why}
                for s in batch if row_key(task, st.policy_name, st.label, s["id"]) not in store]
        store.add(rows)
        bar.update(len(rows))
    todo = [st for st in todo if st.kv_quant is None]
    if not todo:
        return
    full = logits_fn(batch, policy=None, compression_ratio=None, budget=None)
    for st in todo:
        bar.set_postfix_str(f"{task} {st.policy_name} {st.label}")
        start = time.perf_counter()
        try:
            comp = full if st.policy is None else logits_fn(batch, **st.kwargs())
        except ValueError as err:  # the full-cache call ran, so this is the setting (e.g. budget < window)
            warnings.warn(f"{task} {st.policy_name} {st.label}: not run ({err})")
            rows = [{**_base_row(task, st, s, query_aware), "prediction": None, "answers": [], "score": None,
                     "metrics": {}, "stats": {}, "seconds": 0.0, "error": str(err)}
                    for s in batch if row_key(task, st.policy_name, st.label, s["id"]) not in store]
            store.add(rows)
            bar.update(len(rows))
            continue
        seconds = (time.perf_counter() - start) / len(batch)
        rows = []
        for sample, f, c in zip(batch, full, comp):
            if row_key(task, st.policy_name, st.label, sample["id"]) in store:
                continue
            kl, top1 = kl_divergence(f, c), top1_agreement(f, c)
            rows.append({**_base_row(task, st, sample, query_aware), "prediction": None, "answers": [],
                         "score": top1, "metrics": {"kl": kl}, "stats": {},
                         "seconds": seconds})
        store.add(rows)
        bar.update(len(rows))
