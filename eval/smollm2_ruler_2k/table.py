"""The real-model table (issue 29): every preset against the full cache at each compression ratio,
question-agnostic and query-aware, from the `results.jsonl` of one or more `python -m kvjax.eval` runs
per protocol (a later folder's rows replace an earlier one's for the same policy, setting and sample).

    python eval/smollm2_ruler_2k/table.py --agnostic DIR [DIR ...] --aware DIR [DIR ...] \\
        [--kvquant DIR [DIR ...]] [--out eval/smollm2_ruler_2k/TABLE.md] [--partial] [--ratios 0.5 0.75] \\
        [--num-samples N]

Writes OUT (Markdown: score ± s.e., the paired difference from the full cache with regressions and
improvements, answer-length drift, wall time) and OUT with .png (score vs ratio per preset, one panel
per protocol). Numbers: `kvjax.eval.paired`. A setting missing samples (fewer than the other settings
of its protocol or than num_samples per task, a task absent, a configured setting without rows) is
refused with its name unless --partial, which marks it incomplete; a setting the policy declined is
listed with its reason.

--kvquant: question-agnostic runs at quantized KV storage (`--kv-quant`): a section of their settings beside
the same presets unquantized (from --agnostic), each with its KV memory as a fraction of the full cache's at
16 bits per element (`stats.kv_bytes16_mean`, the equal-memory axis), paired with the same preset
unquantized and with the full cache, sample by sample.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvjax
from kvjax.eval import paired
from kvjax.eval.runner import make_settings

PROTOCOLS = ("agnostic", "aware")


@dataclass
class Part:
    """One protocol: its folders, deduplicated rows, statuses by (policy, label), seconds."""

    name: str
    folders: list[str]
    rows: list[dict[str, Any]]
    statuses: dict[paired.Key, paired.Status]
    seconds: dict[str, float]  # policy -> sum of its rows' seconds
    dropped: int = 0  # duplicate rows dropped (`differ` of them with another score)
    differ: int = 0
    bad_lines: int = 0
    num_samples: int | None = None
    config_tasks: list[str] = field(default_factory=list)
    title: str = ""


def read_folder(folder: str | pathlib.Path) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """A run folder's rows, its run_config.json ({} without one) and the lines that did not parse (a
    run still writing its last line)."""
    folder = pathlib.Path(folder)
    rows, bad = [], 0
    for line in (folder / "results.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    cfg_path = folder / "run_config.json"
    return rows, (json.loads(cfg_path.read_text()) if cfg_path.exists() else {}), bad


def build_part(name: str, folders: Sequence[str], ratios: Sequence[float], *, partial: bool = False,
               num_samples: int | None = None) -> Part:
    """Reads, deduplicates and compares one protocol's folders over the settings of `ratios` (and the
    full cache); raises `paired.IncompleteError` unless `partial` (see the module doc)."""
    aware = name == "aware"
    labels = {"full", *(f"r={r:g}" for r in ratios)}
    rows, expected, bad, configs = [], [], 0, []
    for folder in folders:
        got, cfg, n_bad = read_folder(folder)
        wrong = sum(bool(r.get("query_aware")) != aware for r in got)
        if wrong:
            raise ValueError(f"{folder}: {wrong} rows are {'question-agnostic' if aware else 'query-aware'}, "
                             f"given as --{name}")
        rows += got
        bad += n_bad
        configs.append(cfg)
        if cfg.get("policies"):
            expected += [(st.policy_name, st.label) for st in make_settings(
                cfg["policies"], [r for r in cfg.get("compression_ratios") or () if r in ratios])]
    rows, dropped, differ = paired.dedupe(r for r in rows if r["setting"] in labels)
    n = num_samples or max((c.get("num_samples") or 0 for c in configs), default=0) or None
    statuses = paired.compare(rows, settings=[("full", "full"), *expected], num_samples=n, partial=True)
    bad_settings = [s for s in statuses if s.state == "incomplete"]
    if bad_settings and not partial:
        raise paired.IncompleteError(paired.incomplete_message(bad_settings, where=f"--{name}"))
    seconds: dict[str, float] = defaultdict(float)
    for r in rows:
        seconds[r["policy"]] += float(r.get("seconds") or 0.0)
    cfg = next((c for c in configs if c), {})
    title = f"{pathlib.Path(cfg['model']).stem}, context {cfg.get('context_length')}" if cfg.get("model") else ""
    tasks = list(dict.fromkeys(t for c in configs for t in c.get("tasks") or ()))
    return Part(name, list(folders), rows, {s.key: s for s in statuses}, dict(seconds), dropped, differ, bad, n,
                tasks, title)


def _cell(status: paired.Status | None, what: str, total: int) -> str:
    if status is None:
        return ""
    if status.state == "incomplete":
        return f"incomplete ({status.n}/{status.n + sum(map(len, status.missing.values()))})"
    if status.state != "complete":
        return status.state
    p = status.paired
    n = "" if p.n == total else f" (n={p.n})"
    if what == "score":
        return paired.plus_minus(p.score, p.score_se) + n
    if what == "diff":
        return f"{paired.plus_minus(p.diff, p.diff_se, sign=True)}, {p.regressions}↓ {p.improvements}↑{n}"
    return paired.drift_text(p) + n


def _sort_key(policy: str, columns: Sequence[tuple[Part, str]]) -> tuple:
    scores = [s.paired.score for part, label in columns
              if (s := part.statuses.get((policy, label))) and s.paired and s.paired.score is not None]
    return (policy != paired.FULL, not scores, -(sum(scores) / len(scores)) if scores else 0.0, policy)


def _full_n(part: Part) -> int:
    full = part.statuses.get(("full", "full"))
    return full.paired.n if full is not None and full.paired is not None else 0


def render(parts: Sequence[Part], ratios: Sequence[float], plot_name: str | None,
           extra: Sequence[str] = ()) -> str:
    """The Markdown of the table (module doc); `extra`: lines of further sections, before the wall time."""
    labels = [f"r={r:g}" for r in ratios]
    columns = [(part, label) for part in parts for label in labels]
    heads = [f"{part.name} {label}" for part, label in columns]
    policies = list(dict.fromkeys(p for part in parts for p, _ in part.statuses))
    policies.sort(key=lambda p: _sort_key(p, columns))
    totals = {part.name: _full_n(part) for part in parts}

    def table(what: str, extra: Sequence[str] = ()) -> list[str]:
        head = ["preset", *heads, *extra]
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for policy in policies:
            if what != "score" and (policy == paired.FULL or not any(
                    (s := part.statuses.get((policy, lb))) and s.paired for part, lb in columns)):
                continue
            cells = []
            for part, label in columns:
                key = (policy, "full" if policy == paired.FULL else label)
                cells.append(_cell(part.statuses.get(key), what, totals[part.name]))
            if what == "score":
                cells += [f"{part.seconds[policy] / 60:.1f}" if policy in part.seconds else "" for part in parts]
            lines.append("| " + " | ".join([policy, *cells]) + " |")
        return lines

    title = next((p.title for p in parts if p.title), "")
    md = [f"# {title + ': ' if title else ''}KV-cache presets against the full cache", ""]
    for part in parts:
        full = part.statuses.get(("full", "full"))
        tasks = sorted({r["task"] for r in part.rows}, key=lambda t: (part.config_tasks + [t]).index(t))
        unrun = [t for t in part.config_tasks if t not in tasks]
        md.append(f"- **{part.name}**: {', '.join(part.folders)}: {len(part.rows)} rows"
                  + (f" ({part.dropped} duplicates dropped, {part.differ} with another score)" if part.dropped else "")
                  + (f", {part.bad_lines} unreadable lines" if part.bad_lines else "")
                  + f"; {len(tasks)} tasks ({', '.join(tasks)})"
                  + (f", {part.num_samples} samples each" if part.num_samples else "")
                  + (f"; every cell pairs {totals[part.name]} samples with the full cache unless it says n"
                     if full and full.paired else "; no complete full cache")
                  + (f"; configured, no rows: {', '.join(unrun)}" if unrun else "") + ".")
    md += ["", "## Score: mean over tasks x 100 ± s.e.", "",
           *table("score", [f"minutes {part.name}" for part in parts]), "",
           "## Against the full cache, paired by sample: difference ± s.e., regressions↓ improvements↑", "",
           *table("diff"), "",
           "## Answer length: generated tokens minus the full cache's (x ratio)", "", *table("length"), "",
           *extra, "## Wall time", ""]
    for part in parts:
        total = sum(part.seconds.values())
        md.append(f"- {part.name}: {total / 3600:.2f} h (sum of the rows' seconds, duplicates dropped), the full cache "
                  f"{part.seconds.get('full', 0.0) / 60:.1f} min")
    md += ["- per preset: the minutes columns above (all its ratios). A batched run answers every setting of "
           "a batch in one call and shares its time evenly among them, so those minutes are that share.", ""]
    md += _not_averaged(parts)
    md += ["Definitions (`kvjax.eval.paired`): mean over tasks of the per-task mean score (as results.md's avg), "
           "s.e. stratified by task; paired difference over the samples both ran; a sample is right when its score "
           f">= {paired.RIGHT_AT:g} (0/1 metrics: correct; string_match_all: half the answers found); regressions: "
           "the full cache right and the preset wrong, improvements the reverse. Rows sorted by the mean of their "
           "scores; blank: not run.", ""]
    if plot_name:
        md += [f"![score vs compression ratio]({plot_name})", ""]
    return "\n".join(md)


def _not_averaged(parts: Sequence[Part]) -> list[str]:
    """Incomplete settings grouped by what they lack, refused ones by reason."""
    incomplete: dict[str, dict[tuple[str, str], list[str]]] = defaultdict(lambda: defaultdict(list))
    refused: dict[str, dict[tuple[str, str], list[str]]] = defaultdict(lambda: defaultdict(list))
    for part in parts:
        for s in part.statuses.values():
            if s.state == "incomplete":
                incomplete[paired.describe_missing(s)][(s.policy, part.name)].append(s.setting)
            elif s.state == "refused":
                for why, tasks in s.reasons.items():
                    refused[f"{why} [{', '.join(tasks)}]"][(s.policy, part.name)].append(s.setting)
    if not incomplete and not refused:
        return []

    def where(found: dict[tuple[str, str], list[str]]) -> str:
        return ", ".join(f"{p} ({name} {', '.join(labels)})" for (p, name), labels in found.items())

    md = ["## Not averaged", ""]
    md += [f"- incomplete, {what}: {where(found)}" for what, found in incomplete.items()]
    md += [f"- refused, {why}: {where(found)}" for why, found in refused.items()]
    return md + [""]


def _bytes16(row: dict[str, Any], itemsize: int) -> float | None:
    """A row's mean KV bytes at its storage, 16 bits per element unquantized (`stats.kv_bytes16_mean`; rows
    recorded before that field: its model-dtype bytes scaled to 16 bits by the model's `itemsize`)."""
    st = row.get("stats") or {}
    if st.get("kv_bytes16_mean") is not None:
        return float(st["kv_bytes16_mean"])
    if row.get("kv_quant", "none") in (None, "none") and st.get("kv_bytes_mean") is not None:
        return float(st["kv_bytes_mean"]) * 2 / itemsize
    return None


def _memory(rows: Sequence[dict[str, Any]], full: dict[str, dict[str, Any]], itemsize: int) -> float | None:
    """Mean over `rows` of their KV bytes over the full cache's at 16 bits per element on the same sample."""
    f = [a / b for r in rows if r["sample_id"] in full
         and (a := _bytes16(r, itemsize)) is not None and (b := _bytes16(full[r["sample_id"]], itemsize))]
    return sum(f) / len(f) if f else None


def model_itemsize(model: str) -> int:
    """Bytes per KV element of the eval's model as `python -m kvjax.eval` loads it (its default dtype)."""
    return int(np.dtype(kvjax.load_model(model, tokenizer=False).config.jnp_dtype).itemsize)


def kvquant_section(folders: Sequence[str], agnostic: Part, *, partial: bool = False,
                    num_samples: int | None = None, itemsize: int | None = None) -> list[str]:
    """The Markdown section of `--kvquant` (module doc); raises `paired.IncompleteError` for a quantized
    setting missing samples unless `partial`. itemsize: the model's bytes per KV element, for unquantized
    rows recorded without `kv_bytes16_mean` (default: loaded from --agnostic's run_config model)."""
    rows = [r for f in folders for r in read_folder(f)[0]]
    if any(r.get("query_aware") for r in rows):
        raise ValueError(f"{list(folders)}: --kvquant takes question-agnostic rows")
    rows, _, _ = paired.dedupe(r for r in rows if r.get("kv_quant", "none") not in (None, "none"))
    tasks = sorted({r["task"] for r in agnostic.rows})
    statuses = paired.compare(rows, num_samples=num_samples or agnostic.num_samples, tasks=tasks, partial=True)
    bad = [st for st in statuses if st.state == "incomplete"]
    if bad and not partial:
        raise paired.IncompleteError(paired.incomplete_message(bad, where="--kvquant"))
    plain = defaultdict(list)  # (policy, label) -> the unquantized rows of --agnostic
    for r in agnostic.rows:
        plain[(r["policy"], r["setting"])].append(r)
    full16 = {r["sample_id"]: r for r in plain[(paired.FULL, "full")]}
    if itemsize is None and any((r.get("stats") or {}).get("kv_bytes16_mean") is None for r in full16.values()):
        itemsize = model_itemsize(read_folder(agnostic.folders[0])[1]["model"])
    groups = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["setting"])].append(r)
    lines = ["| preset | ratio | storage | KV memory (x full, 16-bit) | score | vs the same preset unquantized "
             "| vs the full cache (16-bit) |", "|---|---|---|---:|---:|---:|---:|"]
    first = {p: i for i, p in reversed(list(enumerate(st.policy for st in statuses)))}
    presets = sorted(first, key=lambda p: (p != paired.FULL, first[p]))
    for policy in presets:
        labels = sorted({st.setting.split(" ")[0] for st in statuses if st.policy == policy})
        for label in labels:
            base = plain.get((policy, label), [])
            p16 = paired.pair(base, list(full16.values()))
            lines.append(f"| {policy} | {label if label != 'full' else ''} | none | "
                         f"{_fraction(_memory(base, full16, itemsize))} | {paired.plus_minus(p16.score, p16.score_se)} | | "
                         f"{'' if policy == paired.FULL else paired.plus_minus(p16.diff, p16.diff_se, sign=True)} |")
            for st in statuses:
                if st.policy != policy or st.setting.split(" ")[0] != label:
                    continue
                storage = st.setting.split(" ", 1)[1]
                if st.state != "complete":
                    lines.append(f"| {policy} | | {storage} | | {_cell(st, 'score', 0)} | | |")
                    continue
                g = groups[st.key]
                vs_full = paired.pair(g, list(full16.values()))
                lines.append(f"| {policy} | | {storage} | {_fraction(_memory(g, full16, itemsize))} | "
                             f"{paired.plus_minus(vs_full.score, vs_full.score_se)} | "
                             f"{paired.plus_minus(*_diff(g, base), sign=True)} | "
                             f"{paired.plus_minus(vs_full.diff, vs_full.diff_se, sign=True)} |")
    n = len(full16)
    return ["## Quantized KV storage (question-agnostic)", "",
            f"{', '.join(folders)}: {len(rows)} rows; every cell pairs the samples both sides ran ({n} for the full "
            "cache). KV memory: the entries a row's cache held, in bytes at its storage (codes, scales and zero "
            "points; 16 bits per element unquantized), over the full cache's at 16 bits on the same sample, averaged "
            "over samples: rows with the same memory compare fewer tokens against fewer bits.", "", *lines, ""]


def _diff(rows: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> tuple[float | None, float | None]:
    p = paired.pair(rows, baseline)
    return p.diff, p.diff_se


def _fraction(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def plot(parts: Sequence[Part], ratios: Sequence[float], path: pathlib.Path) -> None:
    """Score (± s.e.) against compression ratio, one line per preset, one panel per protocol; the
    full cache a dashed line. Only complete settings are drawn."""
    import matplotlib
    from matplotlib.figure import Figure

    labels = [f"r={r:g}" for r in ratios]
    policies = sorted({p for part in parts for p, _ in part.statuses if p != paired.FULL})
    colors = [*matplotlib.colormaps["tab20"].colors, *matplotlib.colormaps["tab20b"].colors]
    fig = Figure(figsize=(6 * len(parts) + 3, 6))
    axes = fig.subplots(1, len(parts), sharey=True, squeeze=False)[0]
    for ax, part in zip(axes, parts):
        full = part.statuses.get(("full", "full"))
        if full and full.paired:
            ax.axhline(full.paired.score, color="black", linestyle="--", linewidth=1, label="full")
        for j, policy in enumerate(policies):
            pts = [(r, s.paired) for r, lb in zip(ratios, labels)
                   if (s := part.statuses.get((policy, lb))) and s.paired and s.paired.score is not None]
            if pts:
                ax.errorbar([r for r, _ in pts], [p.score for _, p in pts], yerr=[p.score_se or 0 for _, p in pts],
                            color=colors[j % len(colors)], linestyle=("-", "--", ":")[j // len(colors) % 3],
                            marker="o", markersize=4, capsize=2, label=policy)
        ax.set_title(part.name)
        ax.set_xlabel("compression ratio (fraction removed)")
        ax.set_xticks(list(ratios))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("score (mean over tasks, ± s.e.)")
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 1 - 2.6 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in PROTOCOLS:
        ap.add_argument(f"--{name}", nargs="+", default=[], metavar="DIR",
                        help=f"run folders of the {name} protocol (results.jsonl, run_config.json), later ones win")
    ap.add_argument("--kvquant", nargs="+", default=[], metavar="DIR",
                    help="question-agnostic run folders at quantized KV storage (needs --agnostic)")
    ap.add_argument("--out", default="eval/smollm2_ruler_2k/TABLE.md")
    ap.add_argument("--partial", action="store_true", help="mark settings missing samples instead of refusing")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75])
    ap.add_argument("--num-samples", type=int, default=None, help="samples per task (default: the run configs')")
    args = ap.parse_args(argv)
    if not args.agnostic and not args.aware:
        ap.error("give --agnostic and/or --aware run folders")
    parts, errors = [], []
    for name in PROTOCOLS:
        if getattr(args, name):
            try:
                parts.append(build_part(name, getattr(args, name), args.ratios, partial=args.partial,
                                        num_samples=args.num_samples))
            except paired.IncompleteError as err:
                errors.append(str(err))
    if args.kvquant and not any(p.name == "agnostic" for p in parts):
        ap.error("--kvquant needs --agnostic (the same presets unquantized)")
    extra: list[str] = []
    if args.kvquant and not errors:
        try:
            extra = kvquant_section(args.kvquant, next(p for p in parts if p.name == "agnostic"),
                                    partial=args.partial, num_samples=args.num_samples)
        except paired.IncompleteError as err:
            errors.append(str(err))
    if errors:
        raise paired.IncompleteError("\n".join(errors))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(parts, args.ratios, png)
    text = render(parts, args.ratios, png.name, extra)
    out.write_text(text, encoding="utf-8")
    return text


if __name__ == "__main__":
    try:
        print(main())
    except paired.IncompleteError as err:
        sys.exit(f"table.py: {err}")
