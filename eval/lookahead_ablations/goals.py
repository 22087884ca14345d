"""Issue 27's RULER goals, paired sample by sample: the best LookaheadKV preset of an out-of-distribution
adapter against KVzip (question-agnostic, r = 0.5 and 0.75), and LookaheadKV query-aware against the full cache
(r = 0.75).

    python eval/lookahead_ablations/goals.py --ood OOD_DIR [...] --reference REF_DIR [...] [--n 12] [--skip 4] > GOALS.md

--ood: eval folders of the adapter under test (its LookaheadKV presets: every policy whose name contains
"lookahead", question-agnostic and query-aware rows alike); --reference: folders holding KVzip's and the full
cache's rows on the same samples (e.g. issue 29's 12-sample rounds). Later folders win a repeated sample. Only the
first --n samples of each task count (less the first --skip: the samples a preset's settings were chosen on,
so that the verdict rests on samples it was not tuned on), and only samples present on both sides of a pair; a pair with fewer than
`MIN_SAMPLES` samples is reported but gets no verdict. Scores x 100; diff ± its standard error stratified by task
(`kvjax.eval.paired`).

The best preset is the one with the highest mean paired diff over both ratios among those with at least
`MIN_SAMPLES` paired samples at both (among all when none has).

Verdicts: "met" when the diff reaches the goal; "not met (within 2 s.e.)" when it misses by less than two
standard errors; "not met" otherwise.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from kvjax.eval import paired

MIN_SAMPLES = 88  # the floor: 5 points beyond noise
RATIOS = (0.5, 0.75)
AWARE_GOAL = -3.0  # query-aware: within 3 points of the full cache at r = 0.75


def load(folders: Iterable[str], n: int, skip: int = 0) -> list[dict[str, Any]]:
    """The scored rows of `folders` (later folders win a repeated (policy, setting, protocol, sample)), samples
    `skip` to `n` - 1 of each task."""
    rows: dict[tuple, dict[str, Any]] = {}
    for folder in folders:
        path = pathlib.Path(folder) / "results.jsonl"
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if skip <= int(r["sample_id"].rsplit("/", 1)[1]) < n and r.get("score") is not None:
                    rows[(r["policy"], r["setting"], bool(r.get("query_aware")), r["sample_id"])] = r
    return list(rows.values())


def select(rows: Sequence[dict[str, Any]], policy: str, ratio: float | None, aware: bool) -> list[dict[str, Any]]:
    return [r for r in rows if r["policy"] == policy and r.get("compression_ratio") == ratio
            and bool(r.get("query_aware")) == aware and r.get("kv_quant", "none") in (None, "none")]


def verdict(p: paired.Paired, goal: float) -> str:
    if p.n < MIN_SAMPLES:
        return f"no verdict ({p.n} < {MIN_SAMPLES} samples)"
    if p.diff >= goal:
        return "met"
    if p.diff_se is not None and p.diff + 2 * p.diff_se >= goal:
        return "not met (within 2 s.e.)"
    return "not met"


def goals(ood: Sequence[dict[str, Any]], ref: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Table rows: (goal, setting, adapter preset, its score, the reference's, diff ± s.e., samples, verdict)."""
    presets = sorted({r["policy"] for r in ood if "lookahead" in r["policy"] and not r.get("query_aware")})
    out = []
    best, best_key = None, None
    for preset in presets:  # the best preset: the mean of its paired diffs over both ratios, among the presets
        # with enough samples for a verdict at both ratios when any has them (a 44-sample run does not
        # outrank a 132-sample one by its noise)
        pairs = [paired.pair(select(ood, preset, r, False), select(ref, "kvzip", r, False), baseline="kvzip")
                 for r in RATIOS]
        if any(p.diff is None for p in pairs):
            continue
        key = (all(p.n >= MIN_SAMPLES for p in pairs), sum(p.diff for p in pairs) / 2)
        if best_key is None or key > best_key:
            best, best_key = preset, key
    if best is not None:
        for ratio in RATIOS:
            p = paired.pair(select(ood, best, ratio, False), select(ref, "kvzip", ratio, False), baseline="kvzip")
            out.append(["agnostic >= KVzip", f"r={ratio}", best, f"{p.score:.1f}", f"{p.full:.1f}",
                        paired.plus_minus(p.diff, p.diff_se, sign=True), str(p.n), verdict(p, 0.0)])
    aware = sorted({r["policy"] for r in ood if "lookahead" in r["policy"] and r.get("query_aware")})
    for preset in aware:
        p = paired.pair(select(ood, preset, 0.75, True), select(ref, paired.FULL, None, True))
        if p.n:
            out.append([f"query-aware within {-AWARE_GOAL:.0f} of full", "r=0.75", preset, f"{p.score:.1f}",
                        f"{p.full:.1f}", paired.plus_minus(p.diff, p.diff_se, sign=True), str(p.n),
                        verdict(p, AWARE_GOAL)])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ood", nargs="+", required=True, help="eval folders of the adapter under test")
    ap.add_argument("--reference", nargs="+", required=True, help="eval folders with KVzip's and the full cache's rows")
    ap.add_argument("--n", type=int, default=12, help="samples per task (the first N)")
    ap.add_argument("--skip", type=int, default=0,
                    help="leave out each task's first SKIP samples (those a preset's settings were chosen on)")
    args = ap.parse_args(argv)
    if not 0 <= args.skip < args.n:
        raise SystemExit(f"--skip must be in [0, --n), got {args.skip} with --n {args.n}")
    rows = goals(load(args.ood, args.n, args.skip), load(args.reference, args.n, args.skip))
    if not rows:
        raise SystemExit("no LookaheadKV rows paired with KVzip or the full cache in these folders")
    which = f"the first {args.n}" if not args.skip else f"samples {args.skip}-{args.n - 1}"
    print(f"# Issue 27 goals ({which} of each task)\n")
    print(f"LookaheadKV rows: {', '.join(args.ood)}; reference rows: {', '.join(args.reference)}.\n")
    print("| goal | setting | preset | score | reference | diff ± s.e. | samples | verdict |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
