"""Summaries of result rows: a table (stdout, Markdown, CSV, JSON), a score-vs-compression plot, a
score-vs-KV-bytes plot, and needle-grid heatmaps. Task score = mean of per-sample scores x 100, rounded
to 2 decimals; ``avg`` is the unweighted mean over the tasks (fidelity excluded when other tasks are
present). Beside the scores, each setting's cache as it really was (`CACHE_COLUMNS`), and a mark on
settings whose cache never came down to their budget. Settings with a quantized KV storage
(``--kv-quant``) add a ``kv_quant`` column; ``kv_bytes`` (MiB at 16 bits per element: codes, scales
and zero points of a quantized cache) is the equal-memory axis of ``score_vs_kv_bytes.png``.
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvjax.eval import paired as _paired

if TYPE_CHECKING:
    from kvjax.engine import Setting

# What the numbers mean: printed under the table, in results.md and in `python -m kvjax.eval --help`.
SCORE_NOTE = (
    "score = mean per-sample score x 100 (each sample scores 0-1 by its task's metric, e.g. the fraction "
    "of expected answers found); avg = unweighted mean over the tasks (fidelity left out when other tasks "
    "ran); '-' = not run: the policy refused that ratio, budget or storage (reasons listed).",
    "kept mean / kept peak = KV entries per head (averaged over layers and KV heads) the cache held "
    "while answering, after the question and after each generated token; KV MiB = their key and value "
    "bytes, all layers and heads, per sample (mean); \N{DAGGER} on a setting: its cache never came down to "
    "its budget (see its note).",
    "kv_quant = how the kept keys and values were stored while answering (none: the model dtype); "
    "kv_bytes = the MiB those keys and values take at 16 bits per element (a quantized cache: its codes, "
    "scales and zero points, and its full-precision window at 16 bits), per sample (mean): the equal-memory "
    "axis of score_vs_kv_bytes.png; KV MiB counts the same entries in the model dtype, unquantized.",
)
UNREACHED_MARK = "\N{DAGGER}"
# (header, summary key, scale): the cache each setting actually used, averaged over its samples
CACHE_COLUMNS = (("kept mean", "kept_mean", 1.0), ("kept peak", "kept_peak", 1.0),
                 ("KV MiB", "kv_bytes_mean", 2.0**-20))
# shown when some setting recorded its bytes at 16 bits per element (rows written before that have none)
BYTES16_COLUMN = ("kv_bytes", "kv_bytes16_mean", 2.0**-20)
STORAGE = "kv_quant"  # the column of the settings' KV storage, shown when some setting is quantized
KV_BYTES_PLOT = "score_vs_kv_bytes.png"


def storage_of(setting: Setting) -> str:
    """The setting's KV storage: "none" or the preset name (as `runner.storage_name`)."""
    return "none" if setting.kv_quant is None else setting.kv_quant.name


def _quantized(settings: Sequence[Setting]) -> bool:
    return any(st.kv_quant is not None for st in settings)


def base_label(setting: Setting) -> str:
    """The setting's label without its storage ("r=0.5" for "r=0.5 int4")."""
    suffix = "" if setting.kv_quant is None else " " + storage_of(setting)
    return setting.label[: len(setting.label) - len(suffix)] if suffix and setting.label.endswith(suffix) \
        else setting.label


def summarize(rows: Sequence[dict[str, Any]], tasks: Sequence[str],
              settings: Sequence[Setting]) -> list[dict[str, Any]]:
    """One record per (setting, task) with rows: score, n, nulls (empty predictions), and metric means."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["setting"], r["task"])].append(r)
    out = []
    for st in settings:
        for task in tasks:
            group = groups.get((st.policy_name, st.label, task))
            if not group:
                continue
            errors = [r["error"] for r in group if r.get("score") is None and r.get("error")]
            group = [r for r in group if r.get("score") is not None]
            rec = {"policy": st.policy_name, "setting": st.label, "compression_ratio": st.compression_ratio,
                   "budget": st.budget, "kv_quant": storage_of(st), "task": task,
                   "score": round(100 * sum(r["score"] for r in group) / len(group), 2) if group else None,
                   "n": len(group),
                   "nulls": sum(1 for r in group if r.get("prediction") is not None and not r["prediction"].strip())}
            extras = defaultdict(list)
            for r in group:
                for k, v in (r.get("metrics") or {}).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        extras[k].append(float(v))
            for k, vals in extras.items():
                mean = sum(vals) / len(vals)
                rec[k] = round(mean, 4) if math.isfinite(mean) else mean
            rec.update(_cache_record(group))
            if errors:
                rec["error"] = errors[0]
            out.append(rec)
    return out


def _cache_record(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The cache the rows' answers used (from their stats): mean of kept_mean and kv_bytes_mean,
    max of kept_peak, mean nominal budget, and `unreached`, how many rows never got down to it."""
    stats = [r.get("stats") or {} for r in rows]
    stats = [st for st in stats if "kept_mean" in st]
    if not stats:
        return {}
    rec = {"kept_prefill": round(sum(st.get("kept", 0.0) for st in stats) / len(stats), 2),
           "kept_mean": round(sum(st["kept_mean"] for st in stats) / len(stats), 2),
           "kept_peak": round(max(st["kept_peak"] for st in stats), 2),
           "kv_bytes_mean": round(sum(st["kv_bytes_mean"] for st in stats) / len(stats))}
    b16 = [st["kv_bytes16_mean"] for st in stats if st.get("kv_bytes16_mean") is not None]
    if len(b16) == len(stats):  # every row recorded it (rows written before kvjax did have none)
        rec["kv_bytes16_mean"] = round(sum(b16) / len(b16))
    else:
        rec["kv_bytes16_missing"] = len(stats) - len(b16)
    budgets = [st["budget"] for st in stats if st.get("budget") is not None]
    if budgets:
        rec["budget_mean"] = round(sum(budgets) / len(budgets), 2)
        rec["unreached"] = sum(1 for st in stats if st.get("budget_reached") is False)
    return rec


def cache_by_setting(rows: Sequence[dict[str, Any]], settings: Sequence[Setting]) -> dict[tuple[str, str], dict]:
    """(policy, setting label) -> the cache its answers used over all its tasks (`_cache_record`,
    plus `n`, the rows with cache statistics). Settings without statistics are left out."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("score") is not None:
            groups[(r["policy"], r["setting"])].append(r)
    out = {}
    for st in settings:
        group = groups.get((st.policy_name, st.label), [])
        rec = _cache_record(group)
        if rec:
            n = sum(1 for r in group if "kept_mean" in (r.get("stats") or {}))
            out[(st.policy_name, st.label)] = {"kv_quant": storage_of(st), **rec, "n": n}
    return out


def display_table(header: Sequence[str], body: Sequence[Sequence[Any]],
                  cache: dict[tuple[str, str], dict]) -> tuple[list[str], list[list[Any]], list[str]]:
    """The score table as shown: cache columns appended (when any row has them; `kv_bytes` when some
    setting recorded its bytes at 16 bits), the setting of a row whose cache never came down to its
    budget marked, and with a `kv_quant` column the storage shown there (not in the setting); returns
    the footnote lines too."""
    storage = STORAGE in header
    strip = (lambda label, kvq: label[: -len(kvq) - 1] if kvq != "none" and label.endswith(" " + kvq)  # noqa: E731
             else label)
    if not cache:
        return list(header), [[r[0], strip(r[1], r[2]) if storage else r[1], *r[2:]] for r in body], []
    columns = CACHE_COLUMNS + ((BYTES16_COLUMN,) if any(BYTES16_COLUMN[1] in c for c in cache.values()) else ())
    head = [*header, *(c[0] for c in columns)]
    rows, notes = [], []
    for row in body:
        rec = cache.get((row[0], row[1]), {})
        label = strip(row[1], row[2]) if storage else row[1]
        if rec.get("unreached"):
            label = f"{label}{UNREACHED_MARK}"
            notes.append(f"{UNREACHED_MARK} {row[0]} {row[1]}: the cache never came down to the budget "
                         f"(~{rec['budget_mean']:g} entries per KV head) in {rec['unreached']} of {rec['n']} samples "
                         f"(after prefill it held {rec['kept_prefill']:g}, while answering {rec['kept_mean']:g} "
                         f"on average, {rec['kept_peak']:g} at the peak): these scores are those of a larger "
                         "cache than the setting names.")
        cells = [round(rec[key] * scale, 3) if key in rec else None for _, key, scale in columns]
        rows.append([row[0], label, *row[2:], *cells])
    return head, rows, notes


def wide_table(summary: Sequence[dict[str, Any]], tasks: Sequence[str],
               settings: Sequence[Setting]) -> tuple[list[str], list[list[Any]]]:
    """Header and rows: policy, setting, `kv_quant` (when some setting is quantized: its storage),
    one column per task, avg."""
    score = {(s["policy"], s["setting"], s["task"]): s["score"] for s in summary}
    scored = [t for t in tasks if t != "fidelity"] or list(tasks)
    storage = _quantized(settings)
    header = ["policy", "setting", *([STORAGE] if storage else []), *tasks, "avg"]
    body = []
    for st in settings:
        cells = [score.get((st.policy_name, st.label, t)) for t in tasks]
        vals = [score.get((st.policy_name, st.label, t)) for t in scored if (st.policy_name, st.label, t) in score]
        if not any((st.policy_name, st.label, t) in score for t in tasks):
            continue
        avg = round(sum(vals) / len(vals), 2) if vals and None not in vals else None  # no average over a part
        body.append([st.policy_name, st.label, *([storage_of(st)] if storage else []), *cells, avg])
    return header, body


def pivot_table(summary: Sequence[dict[str, Any]], task: str, key: str,
                settings: Sequence[Setting]) -> tuple[list[str], list[list[Any]]]:
    """One row per policy, one column per ratio / budget: the summary's `key` for `task` (e.g. fidelity KL)."""
    value = {(s["policy"], s["setting"]): s.get(key) for s in summary if s["task"] == task}
    labels = list(dict.fromkeys(st.label for st in settings if st.policy is not None))
    policies = list(dict.fromkeys(st.policy_name for st in settings if st.policy is not None))
    body = [[p, *[value.get((p, lb)) for lb in labels]] for p in policies
            if any((p, lb) in value for lb in labels)]
    return ["policy", *labels], body


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):  # small values (KL divergences) keep their significant digits
        return f"{v:.2f}" if v == 0 or abs(v) >= 1 else f"{v:.3g}"
    return str(v)


def label_columns(header: Sequence[str]) -> int:
    """The leading label columns of a score table: policy, setting (and kv_quant when shown)."""
    return 3 if STORAGE in header else 2


def text_table(header: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    first = label_columns(header)
    cells = [list(header)] + [[_cell(v) for v in row] for row in body]
    widths = [max(len(r[j]) for r in cells) for j in range(len(header))]
    lines = ["  ".join(c.ljust(w) if j < first else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    return _markdown(header, body, first=label_columns(header))


def _markdown(header: Sequence[str], body: Sequence[Sequence[Any]], first: int) -> str:
    """Markdown table whose first `first` columns are labels (left-aligned), the rest numbers."""
    rule = "|".join("---" if j < first else "---:" for j in range(len(header)))
    lines = ["| " + " | ".join(header) + " |", "|" + rule + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


def write_csv(path: pathlib.Path, summary: Sequence[dict[str, Any]]) -> None:
    fields = ["policy", "setting", "compression_ratio", "budget", "kv_quant", "task", "score", "n", "nulls"]
    fields += sorted({k for s in summary for k in s} - set(fields))
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for s in summary:
            writer.writerow({k: s.get(k) for k in fields})


def line_name(setting: Setting) -> str:
    """The line a setting is drawn on: its policy ("full" for the full cache), followed by its storage
    when quantized ("snapkv int4", "full int8")."""
    kvq = storage_of(setting)
    return setting.policy_name if kvq == "none" else f"{setting.policy_name} {kvq}"


def plot_points(summary: Sequence[dict[str, Any]], tasks: Sequence[str], settings: Sequence[Setting],
                cache: dict[tuple[str, str], dict] | None = None) -> dict[str, list[dict[str, Any]]]:
    """What the plot draws, per line (`line_name`: the policy, "full" for the full cache, followed by
    the storage when quantized): points with `x` (the compression ratio, or the budget when no ratio
    ran), `score` (avg over tasks), `kept` (the mean entries per KV head the cache really held, None
    without statistics) and `unreached` (marked settings)."""
    header, body = wide_table(summary, tasks, settings)
    avg = {(r[0], r[1]): r[-1] for r in body}
    use_budget = not any(st.compression_ratio is not None for st in settings)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for st in settings:
        key = (st.policy_name, st.label)
        if avg.get(key) is None:
            continue
        x = 0.0 if st.policy is None and not use_budget else (st.budget if use_budget else st.compression_ratio)
        rec = (cache or {}).get(key, {})
        out[line_name(st)].append({"x": None if x is None else float(x), "score": avg[key],
                                   "kept": rec.get("kept_mean"), "unreached": bool(rec.get("unreached"))})
    return dict(out)


FULL_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))  # the full cache's horizontal line, per storage


def plot_scores(path: pathlib.Path, summary: Sequence[dict[str, Any]], tasks: Sequence[str],
                settings: Sequence[Setting], title: str = "", *,
                cache: dict[tuple[str, str], dict] | None = None) -> bool:
    """Average score against compression ratio (or budget), one line per policy (and storage), and,
    with cache statistics, a second panel against the mean entries per KV head the cache really held;
    settings whose cache never came down to the budget are drawn hollow. The full cache is a
    horizontal line per storage, and each ratio line starts from the full cache of its storage.
    False if nothing to draw."""
    import matplotlib
    from matplotlib.figure import Figure  # drawn without pyplot: the global backend is left alone

    points = plot_points(summary, tasks, settings, cache)
    storage = {line_name(st): storage_of(st) for st in settings}
    full_lines = {line_name(st): storage_of(st) for st in settings if st.policy is None}
    fulls = {full_lines[name]: points.pop(name)[0] for name in list(points) if name in full_lines}
    use_budget = not any(st.compression_ratio is not None for st in settings)
    if not points and not fulls:
        return False
    kept_panel = any(p["kept"] is not None for pts in points.values() for p in pts)
    fig = Figure(figsize=(13 if kept_panel else 8.5, 4.5))
    axes = fig.subplots(1, 2 if kept_panel else 1, squeeze=False)
    colors, markers, styles = matplotlib.colormaps["tab20"].colors, "os^vDP*Xph<>", ("-", "--", ":")
    panels = [("x", axes[0][0])] + ([("kept", axes[0][1])] if kept_panel else [])
    for j, (name, pts) in enumerate(sorted(points.items())):  # no two lines look alike, up to 20 policies
        style = dict(color=colors[j % 20], marker=markers[j % len(markers)], markersize=4,
                     linestyle=styles[j // len(markers) % 3])
        full = fulls.get(storage.get(name, "none"))
        for key, ax in panels:
            pts_k = sorted((p for p in pts if p[key] is not None), key=lambda p: p[key])
            if key == "x" and full is not None and not use_budget:
                pts_k = [full] + pts_k
            ax.plot([p[key] for p in pts_k], [p["score"] for p in pts_k], label=name if key == "x" else None, **style)
            hollow = [p for p in pts_k if p["unreached"]]
            ax.plot([p[key] for p in hollow], [p["score"] for p in hollow], linestyle="none", marker=style["marker"],
                    markersize=7, markerfacecolor="white", markeredgecolor=style["color"])
    ax0 = axes[0][0]
    for i, (kvq, full) in enumerate(fulls.items()):
        name = "full cache" if kvq == "none" else f"full cache {kvq}"
        for key, ax in panels:
            ax.axhline(full["score"], color="black", linestyle=FULL_STYLES[i % len(FULL_STYLES)], linewidth=1,
                       label=name if key == "x" else None)
    ax0.set_xlabel("budget (tokens kept per KV head)" if use_budget else "compression ratio (fraction removed)")
    ax0.set_ylabel("score (avg over tasks)")
    if use_budget:
        ax0.set_xscale("log", base=2)
    if kept_panel:
        ax1 = axes[0][1]
        ax1.set_xlabel("KV entries per head the cache held while answering (mean)")
        ax1.set_xscale("log", base=2)
        ax1.set_title("hollow: the cache never came down to the budget", fontsize=8)
        for full in fulls.values():
            if full["kept"] is not None:
                ax1.plot([full["kept"]], [full["score"]], marker="*", markersize=9, color="black", linestyle="none")
        ax1.grid(alpha=0.3)
    fig.suptitle(title)
    ax0.grid(alpha=0.3)
    (axes[0][-1]).legend(*ax0.get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                         borderaxespad=0)  # beside the plot, not over it
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def kv_bytes_points(summary: Sequence[dict[str, Any]], tasks: Sequence[str], settings: Sequence[Setting],
                    cache: dict[tuple[str, str], dict]) -> tuple[dict[tuple[str, str], list[dict[str, Any]]],
                                                                 list[tuple[str, str]]]:
    """What `score_vs_kv_bytes.png` draws: per (policy, storage) ("full" for the full cache), the
    points of its ratios / budgets sorted by bytes, each with `x` (its mean `kv_bytes16_mean`, MiB per
    sample), `score` (avg over tasks), `label` (the setting without its storage) and `unreached`; and
    the (policy, setting) of the settings with a score but no 16-bit bytes for every sample (rows
    written before kvjax recorded them), which the plot leaves out."""
    header, body = wide_table(summary, tasks, settings)
    avg = {(r[0], r[1]): r[-1] for r in body}
    out: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    missing = []
    for st in settings:
        key = (st.policy_name, st.label)
        if avg.get(key) is None:
            continue
        rec = cache.get(key, {})
        if rec.get("kv_bytes16_mean") is None:
            missing.append(key)
            continue
        out[(st.policy_name, storage_of(st))].append({"x": rec["kv_bytes16_mean"] / 2**20, "score": avg[key],
                                                      "label": base_label(st), "unreached": bool(rec.get("unreached"))})
    return {k: sorted(v, key=lambda p: p["x"]) for k, v in out.items()}, missing


def plot_kv_bytes(path: pathlib.Path, points: dict[tuple[str, str], list[dict[str, Any]]], title: str = ""
                  ) -> Any:
    """Average score against the KV bytes the cache held (MiB per sample at 16 bits per element, log
    scale): one line per (policy, storage) through its ratios / budgets, colour by policy, marker and
    dash by storage; the full cache at each storage a large black marker. Each line is labelled
    "policy storage" (the full cache: "full storage"), so that equal-memory comparisons read off
    directly. Returns the figure (None if nothing to draw), written to `path`."""
    import matplotlib
    import matplotlib.ticker
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    if not points:
        return None
    policies = sorted({p for p, _ in points if p != "full"})
    storages = list(dict.fromkeys(q for _, q in points))
    colors, markers, dashes = matplotlib.colormaps["tab20"].colors, "os^vDPXph", ("-", "--", ":", "-.")
    color = {p: colors[j % 20] for j, p in enumerate(policies)}
    marker = {q: markers[j % len(markers)] for j, q in enumerate(storages)}
    dash = {q: dashes[j % len(dashes)] for j, q in enumerate(storages)}
    fig = Figure(figsize=(10, 5))
    ax = fig.subplots()
    for (policy, kvq), pts in sorted(points.items(), key=lambda kv: (kv[0][0] == "full", kv[0])):
        xs, ys = [p["x"] for p in pts], [p["score"] for p in pts]
        if policy == "full":
            ax.plot(xs, ys, linestyle="none", marker=marker[kvq], markersize=11, color="black",
                    markerfacecolor="none" if kvq == "none" else "black", label=f"full {kvq}", zorder=3)
            continue
        ax.plot(xs, ys, color=color[policy], marker=marker[kvq], markersize=5, linestyle=dash[kvq],
                label=f"{policy} {kvq}")
        hollow = [p for p in pts if p["unreached"]]
        ax.plot([p["x"] for p in hollow], [p["score"] for p in hollow], linestyle="none", marker=marker[kvq],
                markersize=8, markerfacecolor="white", markeredgecolor=color[policy], label="_unreached")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("KV bytes the cache held while answering, MiB per sample (mean, 16 bits per element; "
                  "quantized: codes + scales + zero points)", fontsize=8)
    ax.set_ylabel("score (avg over tasks)")
    ax.grid(alpha=0.3, which="both")
    # two legends: colour = policy, marker and dash = storage (one entry per line would not fit)
    by_policy = [Line2D([], [], color=color[p], label=p) for p in policies]
    by_policy += [Line2D([], [], color="black", marker="o", markerfacecolor="none", linestyle="none",
                         markersize=9, label="full cache")] if any(p == "full" for p, _ in points) else []
    by_storage = [Line2D([], [], color="gray", marker=marker[q], linestyle=dash[q], label=q) for q in storages]
    first = ax.legend(handles=by_policy, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                      title="policy", title_fontsize=7)
    ax.add_artist(first)
    ax.legend(handles=by_storage, fontsize=7, loc="lower left", bbox_to_anchor=(1.01, 0.0), borderaxespad=0,
              title="kv_quant", title_fontsize=7)
    ax.set_title("hollow: the cache never came down to the budget; the full cache: black markers", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legends sit outside the axes
    return fig


def niah_matrices(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per setting ("policy setting"): lengths, depths and the depth x length matrix of mean scores x 100."""
    cells: dict[str, dict[tuple[int, float], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "grid" in r and r.get("score") is not None:
            cells[f"{r['policy']} {r['setting']}"][(r["grid"]["length"], r["grid"]["depth"])].append(r["score"])
    out = {}
    for name, grid in cells.items():
        lengths = sorted({k[0] for k in grid})
        depths = sorted({k[1] for k in grid})
        matrix = [[round(100 * sum(grid[(ln, d)]) / len(grid[(ln, d)]), 2) if (ln, d) in grid else None
                   for ln in lengths] for d in depths]
        flat = [v for row in matrix for v in row if v is not None]
        out[name] = {"lengths": lengths, "depths": depths, "matrix": matrix, "mean": round(sum(flat) / len(flat), 2)}
    return out


def plot_heatmaps(folder: pathlib.Path, matrices: dict[str, dict[str, Any]]) -> list[pathlib.Path]:
    """One PNG per setting: depth (rows) x context length (columns), score 0-100."""
    from matplotlib.figure import Figure  # drawn without pyplot: the global backend is left alone
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, m in matrices.items():
        data = np.array([[np.nan if v is None else v for v in row] for row in m["matrix"]], dtype=float)
        fig = Figure(figsize=(1.2 + 0.7 * len(m["lengths"]), 1.2 + 0.45 * len(m["depths"])))
        ax = fig.subplots()
        im = ax.imshow(data, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(m["lengths"])), [str(x) for x in m["lengths"]], fontsize=7)
        ax.set_yticks(range(len(m["depths"])), [f"{d:g}" for d in m["depths"]], fontsize=7)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (%)")
        ax.set_title(f"{name}: mean {m['mean']:.1f}", fontsize=9)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = folder / (name.replace(" ", "_").replace("=", "").replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _not_run(summary: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Every reason a setting did not run on some task, with where: "policy setting (task, task); ..."
    (one entry per distinct reason, so that a setting refused for two reasons shows both)."""
    where: dict[str, dict[tuple[str, str], list[str]]] = defaultdict(lambda: defaultdict(list))
    for s in summary:
        if s.get("error"):
            where[s["error"]][(s["policy"], s["setting"])].append(s["task"])
    return {why: "; ".join(f"{p} {label} ({', '.join(tasks)})" for (p, label), tasks in settings.items())
            for why, settings in where.items()}


def paired_section(rows: Sequence[dict[str, Any]], tasks: Sequence[str],
                   settings: Sequence[Setting]) -> tuple[list[str], list[dict[str, Any]]]:
    """Markdown lines of "Paired against the full cache" (`kvjax.eval.paired`: score and its
    difference from the full cache over the same samples, regressions, improvements, answer-length
    drift; a setting missing samples is marked incomplete, not averaged) and its records for
    metrics.json. Empty without a full-cache setting or another one to pair with it."""
    rows = [r for r in rows if r["task"] in set(tasks)]
    ran = {(r["policy"], r["setting"]) for r in rows}
    keys = [(st.policy_name, st.label) for st in settings if (st.policy_name, st.label) in ran]
    if not any(p == _paired.FULL for p, _ in keys) or all(p == _paired.FULL for p, _ in keys):
        return [], []
    statuses = [s for s in _paired.compare(rows, settings=keys, tasks=tasks, partial=True)
                if s.policy != _paired.FULL and s.state != "refused"]
    head = ["policy", "setting", "n", "score ± s.e.", "vs full ± s.e.", "regressions", "improvements",
            "length drift (tokens)"]
    body, records = [], []
    for s in statuses:
        p = s.paired
        if p is None:
            body.append([s.policy, s.setting, s.n, "incomplete: " + _paired.describe_missing(s), "", "", "", ""])
            records.append({"policy": s.policy, "setting": s.setting, "state": s.state, "missing": s.missing})
            continue
        body.append([s.policy, s.setting, p.n, _paired.plus_minus(p.score, p.score_se),
                     _paired.plus_minus(p.diff, p.diff_se, sign=True), p.regressions, p.improvements,
                     _paired.drift_text(p)])
        records.append({"policy": s.policy, "setting": s.setting, "state": s.state, **vars(p)})
    lines = ["", "## Paired against the full cache", "", _markdown(head, body, first=2), "",
             f"Over the samples both ran (n); score = mean over tasks x 100, s.e. stratified by task; right = score "
             f">= {_paired.RIGHT_AT:g}: regressions = samples the full cache gets right and the setting wrong, "
             "improvements the reverse; length drift = the setting's mean generated tokens minus the full "
             "cache's (x their ratio)."]
    return lines, records


def write_reports(out_dir: str | pathlib.Path, rows: Sequence[dict[str, Any]], tasks: Sequence[str],
                  settings: Sequence[Setting], *, skipped: dict[str, str] | None = None, title: str = "",
                  echo: bool = True) -> dict[str, Any]:
    """Writes results.md, results.csv, metrics.json, the plots and heatmaps; prints the table. Returns the
    summary. `score_vs_kv_bytes.png` is drawn when some setting recorded its KV bytes at 16 bits per
    element; settings without them (rows written before kvjax recorded them) are named as left out."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ran = [t for t in tasks if any(r["task"] == t for r in rows)]
    summary = summarize(rows, ran, settings)
    header, body = wide_table(summary, ran, settings)
    cache = cache_by_setting(rows, settings)
    shown_head, shown, footnotes = display_table(header, body, cache)
    plotted = bool(body) and plot_scores(out / "score_vs_compression.png", summary, ran, settings, title, cache=cache)
    kv_points, kv_left_out = kv_bytes_points(summary, ran, settings, cache)
    kv_plotted = bool(body) and plot_kv_bytes(out / KV_BYTES_PLOT, kv_points, title) is not None
    matrices = niah_matrices(rows)
    heatmaps = plot_heatmaps(out / "niah_heatmaps", matrices) if matrices else []
    if matrices:
        (out / "niah_grid.json").write_text(json.dumps(matrices, indent=2))
    write_csv(out / "results.csv", summary)
    paired_md, paired_records = paired_section(rows, ran, settings) if body else ([], [])
    (out / "metrics.json").write_text(json.dumps({
        "summary": summary, "table": {"header": header, "rows": body},
        "cache": [{"policy": p, "setting": lb, **rec} for (p, lb), rec in cache.items()],
        "kv_bytes_plot": {"lines": [{"policy": p, "kv_quant": q, "points": pts} for (p, q), pts in kv_points.items()],
                          "left_out": [{"policy": p, "setting": lb} for p, lb in kv_left_out]} if kv_plotted else None,
        "paired": paired_records, "skipped": skipped or {}}, indent=2))
    not_run = _not_run(summary)
    notes = [*SCORE_NOTE, *footnotes] if body else []
    md = [f"# {title or 'kvjax.eval results'}", "", markdown_table(shown_head, shown) if body else "(no results)", ""]
    md += [f"{line}  " for line in notes] + ([""] if notes else [])
    if plotted:
        md += ["![score vs compression](score_vs_compression.png)", ""]
    if kv_plotted:
        md += [f"![score vs KV bytes]({KV_BYTES_PLOT})", ""]
    why = "rows written before kvjax recorded them; a fresh --out records them"
    if body and cache and kv_plotted and kv_left_out:
        md += [f"Left out of {KV_BYTES_PLOT}, without 16-bit KV bytes for every sample ({why}): "
               + ", ".join(f"{p} {lb}" for p, lb in kv_left_out) + ".", ""]
    elif body and cache and not kv_plotted:
        md += [f"{KV_BYTES_PLOT} not drawn: no setting has 16-bit KV bytes for every sample ({why}).", ""]
    for p in heatmaps:
        md += [f"![{p.stem}](niah_heatmaps/{p.name})"]
    md += paired_md
    if "fidelity" in ran:
        for key, what in (("kl", "next-token KL(full || compressed), nats (lower is better)"),
                          ("score", "top-1 agreement with the full cache, % (higher is better)")):
            head, rows_ = pivot_table(summary, "fidelity", key, settings)
            md += ["", f"## Fidelity: {what}", "", _markdown(head, rows_, first=1)]
    if skipped:
        md += ["", "## Skipped tasks", ""] + [f"- **{t}**: {why}" for t, why in skipped.items()]
    if not_run:
        md += ["", "## Settings not run (shown as -)", ""]
        md += [f"- **{where}**: {why}" for why, where in not_run.items()]
    (out / "results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    if echo:
        print(text_table(shown_head, shown) if body else "(no results)")
        lines = notes + [f"- {where}: not run: {why}" for why, where in not_run.items()]
        if lines:
            print("\n" + "\n".join(lines))
    return {"summary": summary, "header": header, "rows": body, "plot": plotted, "heatmaps": heatmaps,
            "kv_plot": kv_plotted, "kv_bytes_points": kv_points, "kv_bytes_left_out": kv_left_out}
