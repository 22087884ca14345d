"""Writes the report of a run still in progress from its results.jsonl: only the first `n` samples of
each task, and only tasks where every setting has all of them, so every number averages the same samples.

    python eval/smollm2_ruler_2k/partial_report.py RUN_DIR OUT_DIR N
"""

import json
import pathlib
import sys

from kvjax.eval import report, runner
from kvjax.eval.tasks import TASKS


def main(run_dir: str, out_dir: str, n: int) -> None:
    run = pathlib.Path(run_dir)
    cfg = json.loads((run / "run_config.json").read_text())
    settings = runner.make_settings(cfg["policies"], cfg["compression_ratios"], cfg["budgets"] or (),
                                    kv_quant=cfg.get("kv_quant") or ("none",))
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if int(r["sample_id"].rsplit("/", 1)[1]) < n]
    done = {(r["task"], r["policy"], r["setting"]) for r in rows}
    counts = {}
    for r in rows:
        counts[(r["task"], r["policy"], r["setting"])] = counts.get((r["task"], r["policy"], r["setting"]), 0) + 1
    tasks = [t for t in cfg["tasks"] if t in TASKS and all(
        counts.get((t, st.policy_name, st.label), 0) == n for st in settings)]
    rows = [r for r in rows if r["task"] in tasks]
    protocol = "query-aware" if cfg.get("query_aware") else "query-agnostic"
    title = f"{cfg['model']}, context {cfg['context_length']}, {protocol} ({n} samples per task, {len(tasks)} tasks)"
    report.write_reports(out_dir, rows, tasks, settings, title=title)
    print(f"{len(tasks)} tasks x {n} samples; {len(done)} (task, setting) pairs seen")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
