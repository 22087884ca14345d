"""The quantized-storage run (issue 26) against its goals: every (policy, ratio) at each storage paired with
the same policy and ratio unquantized, sample by sample, and the equal-memory pairs (r=0.875 at 16 bits
against r=0.5 at int4). Only tasks where every setting of the run has all N samples are used, so every
number averages the same samples (a run in progress gives a partial verdict, and says so).

    python eval/smollm2_ruler_2k/kvquant_goals.py RUN_DIR N > eval/smollm2_ruler_2k/kvquant/GOALS.md

Scores x 100 (mean over tasks of each task's mean); diff = storage - unquantized over the paired samples,
with its stratified standard error (`kvjax.eval.paired`); KV MiB = the kv_bytes16 of the answer's cache
(codes, scales, zero points and the full-precision window at 16 bits per element), mean per sample.
"""

import json
import pathlib
import sys
from collections import defaultdict

from kvjax.eval import paired, runner
from kvjax.eval.tasks import TASKS

GOALS = {"int8": 0.5, "int8_g16": 0.5, "int4": 1.5, "int2_hadamard": 5.0}  # points an eviction policy may lose to its storage
EQUAL_MEMORY = (("r=0.875", "r=0.5 int4"),)  # (16-bit setting, quantized setting) of about equal bytes


def _mib(rows: list[dict]) -> float:
    vals = [r["stats"]["kv_bytes16_mean"] for r in rows if (r.get("stats") or {}).get("kv_bytes16_mean")]
    return sum(vals) / len(vals) / 2**20 if vals else float("nan")


def _by_task(rows: list[dict]) -> dict[str, list[float]]:
    out = defaultdict(list)
    for r in rows:
        if r.get("score") is not None:
            out[r["task"]].append(100 * r["score"])
    return out


def main(run_dir: str, n: int) -> None:
    run = pathlib.Path(run_dir)
    cfg = json.loads((run / "run_config.json").read_text())
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    rows, _, _ = paired.dedupe(r for r in rows if int(r["sample_id"].rsplit("/", 1)[1]) < n)
    groups = defaultdict(list)
    for r in rows:
        groups[(r["policy"], r["setting"])].append(r)
    settings = runner.make_settings(cfg["policies"], cfg["compression_ratios"], cfg["budgets"] or (),
                                    kv_quant=cfg.get("kv_quant") or ("none",))
    counts = defaultdict(int)
    for r in rows:
        counts[(r["task"], r["policy"], r["setting"])] += 1
    tasks = [t for t in cfg["tasks"] if t in TASKS and all(
        counts[(t, st.policy_name, st.label)] == n for st in settings)]
    all_tasks = [t for t in cfg["tasks"] if t in TASKS and t not in ("qa_1", "qa_2")]
    rows = [r for r in rows if r["task"] in tasks]
    groups = {k: [r for r in g if r["task"] in tasks] for k, g in groups.items()}
    state = "complete" if len(tasks) == len(all_tasks) else f"PARTIAL: {len(tasks)} of {len(all_tasks)} tasks"
    print(f"# Quantized storage against the issue-26 goals ({state})\n")
    print(f"{cfg['model'].rsplit('/', 1)[-1]}, RULER {cfg['context_length']}, question-agnostic, {n} samples per "
          f"task, tasks: {', '.join(tasks)} ({len(tasks) * n} paired samples per setting).\n")
    print("| policy | ratio | storage | score | unquantized | diff ± s.e. | regressions / improvements | KV MiB | goal |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    verdicts = defaultdict(list)
    for (policy, label), group in groups.items():
        storage = group[0]["kv_quant"] if group else "none"
        if storage == "none" or policy == "full" and label == "full":
            continue
        ratio = label.split(" ")[0] if policy != "full" else "full"
        base_label = "full" if policy == "full" else ratio
        base = groups.get((policy, base_label), [])
        p = paired.pair(group, base, baseline=base_label)
        goal = GOALS.get(storage)
        met = "" if goal is None or p.diff is None else ("met" if p.diff >= -goal else f"missed by {-goal - p.diff:.1f}")
        if len(group) < len(tasks) * n:  # a storage added to the run later, still running: no verdict yet
            met, goal = f"partial: {len(group)} of {len(tasks) * n} samples", None
        if goal is not None and p.diff is not None:
            verdicts[storage].append(p.diff >= -goal)
        print(f"| {policy} | {ratio} | {storage} | {p.score:.1f} | {p.full:.1f} | "
              f"{paired.plus_minus(p.diff, p.diff_se, sign=True)} | {p.regressions} / {p.improvements} | "
              f"{_mib(group):.3f} | {met} |")
    print("\n## Score (KV bytes relative to the full cache at 16 bits), every storage\n")
    storages = list(dict.fromkeys(g[0]["kv_quant"] for g in groups.values() if g))
    full_mib = _mib(groups.get(("full", "full"), []))
    print("| policy | ratio | " + " | ".join(storages) + " |")
    print("|---|---|" + "---:|" * len(storages))
    for key in dict.fromkeys((p, l.split(" ")[0]) for p, l in groups):
        cells = []
        for st in storages:
            label = key[1] if st == "none" else f"{key[1]} {st}"
            g = groups.get((key[0], label), [])
            mean, _ = paired.task_mean_se(_by_task(g))
            cells.append("" if mean is None else f"{mean:.1f} ({_mib(g) / full_mib:.3f})")
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    print("\n## Goals\n")
    for storage, goal in GOALS.items():
        v = verdicts.get(storage, [])
        if not v:
            continue
        print(f"- {storage}: within {goal} points of the unquantized cache in {sum(v)} of {len(v)} "
              f"(policy, ratio) settings, the full cache included.")
    naive = [paired.pair(g, groups.get((p, l.split(" ")[0] if p != "full" else "full"), [])).diff
             for (p, l), g in groups.items() if g and g[0]["kv_quant"] == "int2"]
    naive = [d for d in naive if d is not None]
    if naive:
        print(f"- naive group-wise int2 (no rotation) loses {-max(naive):.1f} to {-min(naive):.1f} points.")
    print("\n## Equal memory\n")
    print("| policy | 16-bit setting | score | KV MiB | quantized setting | score | KV MiB | diff ± s.e. (quantized - 16-bit) |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for policy in cfg["policies"]:
        for wide, narrow in EQUAL_MEMORY:
            a, b = groups.get((policy, wide), []), groups.get((policy, narrow), [])
            if not a or not b:
                print(f"| {policy} | {wide} | not run yet | | {narrow} | | | |")
                continue
            p = paired.pair(b, a, baseline=wide)
            print(f"| {policy} | {wide} | {p.full:.1f} | {_mib(a):.3f} | {narrow} | {p.score:.1f} | {_mib(b):.3f} | "
                  f"{paired.plus_minus(p.diff, p.diff_se, sign=True)} |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
