"""Each setting against the full cache, sample by sample, and the check that a table averages every
setting over the same samples.

Rows are `results.jsonl` rows; the fields used are policy, setting, task, sample_id, score (0-1, None
when not run), error, kv_quant and stats.generated_tokens. Every score here is x 100.

- mean: the unweighted mean over tasks of each task's mean score (as the report's ``avg``; fidelity
  left out when other tasks ran).
- s.e.: stratified by task (the tasks are fixed, the samples drawn within each):
  ``sqrt(sum_t s_t**2 / n_t) / T``, with ``s_t`` the sample standard deviation (ddof 1) of task t's
  ``n_t`` scores; None when some task has a single sample. The paired difference uses the same formula
  on ``d_i = score_i - full_i``.
- right: a sample scoring >= `RIGHT_AT` (0.5). For the 0/1 metrics (string_match_part, exact match)
  that is a score of 1; for string_match_all (the fraction of expected answers found) half of them.
  regressions: paired samples the full cache gets right and the setting wrong; improvements: the reverse.
- drift: the setting's mean generated tokens minus the full cache's, over the paired samples with
  ``stats.generated_tokens`` on both sides; ``drift_ratio``: the setting's mean over the full cache's.

Only samples scored in both the setting and its baseline are paired (`Paired.n`). The baseline is the
full cache at the setting's storage (``full int4`` for ``r=0.5 int4``) when it ran, else ``full``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

RIGHT_AT = 0.5
FULL = "full"
SHOWN_IDS = 6  # missing sample ids named per task in an error message

Key = tuple[str, str]  # (policy, setting label)


@dataclass(frozen=True)
class Paired:
    """A setting against its baseline over `n` paired samples of `tasks` tasks (scores x 100)."""

    baseline: str
    n: int
    tasks: int
    score: float | None
    score_se: float | None
    full: float | None
    full_se: float | None
    diff: float | None
    diff_se: float | None
    regressions: int
    improvements: int
    tokens: float | None = None
    full_tokens: float | None = None
    drift: float | None = None
    drift_ratio: float | None = None


@dataclass(frozen=True)
class Status:
    """One setting of a table. state: "complete" (averaged), "incomplete" (`missing`: task -> the
    sample ids it lacks, `expected`: task -> how many it should have) or "refused" (`reasons`: why -> tasks)."""

    policy: str
    setting: str
    state: str
    n: int
    missing: dict[str, list[str]] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    paired: Paired | None = None

    @property
    def key(self) -> Key:
        return (self.policy, self.setting)


class IncompleteError(ValueError):
    """A table was asked to average settings missing samples; the message names them."""


def dedupe(rows: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, int]:
    """One row per (policy, setting, sample_id), the last one winning (a later folder reruns an
    earlier one); returns the rows (in first-seen order), the duplicates dropped and how many of
    those had a different score from the row kept."""
    kept: dict[tuple[str, str, str], dict[str, Any]] = {}
    dropped = differ = 0
    for r in rows:
        key = (r["policy"], r["setting"], r["sample_id"])
        if key in kept:
            dropped += 1
            differ += kept[key].get("score") != r.get("score")
        kept[key] = r
    return list(kept.values()), dropped, differ


def task_mean_se(by_task: dict[str, Sequence[float]]) -> tuple[float | None, float | None]:
    """The mean over tasks of each task's mean, and its stratified standard error (module doc);
    (None, None) without values."""
    groups = [list(v) for v in by_task.values() if len(v)]
    if not groups:
        return None, None
    means = [sum(v) / len(v) for v in groups]
    mean = sum(means) / len(groups)
    if any(len(v) < 2 for v in groups):
        return mean, None
    var = sum(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v) for v, m in zip(groups, means))
    return mean, math.sqrt(var) / len(groups)


def scored_tasks(tasks: Iterable[str]) -> set[str]:
    """The tasks a mean averages: all but fidelity, unless fidelity is all there is."""
    tasks = set(tasks)
    return tasks - {"fidelity"} or tasks


def pair(rows: Sequence[dict[str, Any]], full_rows: Sequence[dict[str, Any]], *,
         right_at: float = RIGHT_AT, baseline: str = FULL) -> Paired:
    """`rows` (one setting) against `full_rows` (its baseline) over the sample ids scored in both."""
    full = {r["sample_id"]: r for r in full_rows if r.get("score") is not None}
    mine = {r["sample_id"]: r for r in rows if r.get("score") is not None}
    both = [i for i in mine if i in full]
    keep = scored_tasks(mine[i]["task"] for i in both)
    both = [i for i in both if mine[i]["task"] in keep]
    a, b, d = defaultdict(list), defaultdict(list), defaultdict(list)
    for i in both:
        task, x, y = mine[i]["task"], 100 * mine[i]["score"], 100 * full[i]["score"]
        a[task].append(x)
        b[task].append(y)
        d[task].append(x - y)
    (score, score_se), (base, base_se), (diff, diff_se) = task_mean_se(a), task_mean_se(b), task_mean_se(d)
    regressions = sum(full[i]["score"] >= right_at > mine[i]["score"] for i in both)
    improvements = sum(mine[i]["score"] >= right_at > full[i]["score"] for i in both)
    toks = [(_tokens(mine[i]), _tokens(full[i])) for i in both]
    toks = [(x, y) for x, y in toks if x is not None and y is not None]
    length = {}
    if toks:
        x, y = sum(t[0] for t in toks) / len(toks), sum(t[1] for t in toks) / len(toks)
        length = {"tokens": x, "full_tokens": y, "drift": x - y, "drift_ratio": x / y if y else None}
    return Paired(baseline=baseline, n=len(both), tasks=len(a), score=score, score_se=score_se, full=base,
                  full_se=base_se, diff=diff, diff_se=diff_se, regressions=regressions,
                  improvements=improvements, **length)


def _tokens(row: dict[str, Any]) -> float | None:
    v = (row.get("stats") or {}).get("generated_tokens")
    return None if v is None else float(v)


def expected_ids(rows: Sequence[dict[str, Any]], num_samples: int | None = None,
                 tasks: Iterable[str] = ()) -> dict[str, set[str]]:
    """task -> the sample ids every setting should have: those any row has, and with `num_samples`,
    ``task/0`` .. ``task/{num_samples-1}`` for a task whose ids are all of that form (the generated
    tasks). `tasks` adds tasks that must be there even with no rows at all."""
    out: dict[str, set[str]] = {t: set() for t in tasks}
    for r in rows:
        out.setdefault(r["task"], set()).add(r["sample_id"])
    if num_samples:
        for task, ids in out.items():
            pattern = re.compile(re.escape(task) + r"/\d+")
            if all(pattern.fullmatch(i) for i in ids):
                ids.update(f"{task}/{i}" for i in range(num_samples))
    return out


def baseline_of(storage: str, labels: Iterable[str]) -> str:
    """The full-cache label a setting pairs with: the full cache at its storage when it ran, else "full"."""
    same = FULL if storage == "none" else f"{FULL} {storage}"
    return same if same in set(labels) else FULL


def compare(rows: Sequence[dict[str, Any]], *, settings: Iterable[Key] = (), num_samples: int | None = None,
            tasks: Iterable[str] = (), partial: bool = False, right_at: float = RIGHT_AT) -> list[Status]:
    """The status of every setting in `rows` (and of every (policy, label) in `settings`, rows or not),
    complete ones paired with their baseline. Expected samples: `expected_ids`. Raises `IncompleteError`
    naming the settings missing samples unless `partial`; a setting with any error row is "refused"
    (with its reasons), never missing. Order: `settings` first, then as the rows first name them."""
    groups: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["setting"])].append(r)
    order = list(dict.fromkeys([*settings, *groups]))
    want = expected_ids(rows, num_samples, tasks)
    fulls = {label: g for (p, label), g in groups.items() if p == FULL}
    out = []
    for policy, label in order:
        group = groups.get((policy, label), [])
        reasons: dict[str, list[str]] = defaultdict(list)
        for r in group:
            if r.get("score") is None and r.get("error"):
                if r["task"] not in reasons[r["error"]]:
                    reasons[r["error"]].append(r["task"])
        have = {r["sample_id"] for r in group}
        missing = {t: sorted(ids - have, key=_natural) for t, ids in want.items() if ids - have}
        if reasons:
            out.append(Status(policy, label, "refused", len(group), reasons=dict(reasons)))
        elif missing:
            out.append(Status(policy, label, "incomplete", len(group), missing=missing,
                              expected={t: len(want[t]) for t in missing}))
        else:
            storage = group[0].get("kv_quant", "none") if group else "none"
            base = baseline_of(storage, fulls) if policy != FULL else label
            paired = pair(group, fulls.get(base, []), right_at=right_at, baseline=base)
            out.append(Status(policy, label, "complete", len(group), paired=paired))
    bad = [s for s in out if s.state == "incomplete"]
    if bad and not partial:
        raise IncompleteError(incomplete_message(bad))
    return out


def _natural(sample_id: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", sample_id))


def describe_missing(status: Status) -> str:
    """"vt absent (4 samples), cwe 2 of 4 missing (cwe/2, cwe/3)": what a setting lacks, per task."""
    parts = []
    for task, ids in status.missing.items():
        total = status.expected.get(task, len(ids))
        if len(ids) == total:
            parts.append(f"{task} absent ({total} samples)")
            continue
        shown = ", ".join(ids[:SHOWN_IDS]) + (", ..." if len(ids) > SHOWN_IDS else "")
        parts.append(f"{task} {len(ids)} of {total} missing ({shown})")
    return "; ".join(parts)


def incomplete_message(bad: Sequence[Status], where: str = "") -> str:
    lines = [f"refusing to average {len(bad)} setting(s){' of ' + where if where else ''} missing samples "
             "(a partial table marks them incomplete instead: partial=True, --partial):"]
    lines += [f"  {s.policy} {s.setting}: {describe_missing(s)}" for s in bad]
    return "\n".join(lines)


def plus_minus(mean: float | None, se: float | None, digits: int = 1, sign: bool = False) -> str:
    """"55.1 ± 3.6" ("+2.0 ± 1.1" with `sign`; "55.1 ± ?" when the s.e. is unknown, "-" without a mean)."""
    if mean is None:
        return "-"
    m = f"{mean:+.{digits}f}" if sign else f"{mean:.{digits}f}"
    return f"{m} ± {'?' if se is None else f'{se:.{digits}f}'}"


def drift_text(p: Paired) -> str:
    """"+5.7 (x1.11)": answer-length drift in generated tokens and its ratio ("-" without token counts)."""
    if p.drift is None:
        return "-"
    return f"{p.drift:+.1f}" + ("" if p.drift_ratio is None else f" (x{p.drift_ratio:.2f})")
