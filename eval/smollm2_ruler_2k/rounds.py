"""The real-model table's follow-up rounds (issue 29): the N best presets of a protocol again at more
samples per task, and the best presets' rows on quantized KV storage.

    # the N best presets of a finished protocol (one name per line)
    python eval/smollm2_ruler_2k/rounds.py best --from eval/smollm2_ruler_2k/table_agnostic --n 8
    # a round: seeds OUT with the best presets' (and the full cache's) rows from --from, then runs the eval
    # with --num-samples into OUT, so that only the new samples are computed (resumable: re-run it)
    python eval/smollm2_ruler_2k/rounds.py run --from eval/smollm2_ruler_2k/table_agnostic --n 8 \\
        --out eval/smollm2_ruler_2k/table_agnostic_12 -- --num-samples 12
    # the 4 best at int8_g16 and int4 storage (no seeding: every row is new)
    python eval/smollm2_ruler_2k/rounds.py run --from eval/smollm2_ruler_2k/table_agnostic --n 4 --no-seed \\
        --out eval/smollm2_ruler_2k/table_kvquant -- --kv-quant int8_g16 int4

"Best": the mean score over the compression ratios (each a complete setting, paired with the full cache),
highest first, leaving out the full cache and any preset whose cache never came down to its budget in most
samples at some ratio (its scores are those of a larger cache than the setting names). The eval command is
--from's run_config.json as the eval's --config (model, tasks, seed, protocol, batch size, ratios, adapter)
with the chosen policies; arguments after `--` are added to it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from collections.abc import Sequence

from kvjax.eval import paired

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from table import build_part, read_folder  # noqa: E402


def never_reached(rows: Sequence[dict]) -> set[str]:
    """Presets with a setting whose cache missed its budget (`stats.budget_reached` False) in more than
    half of that setting's rows."""
    missed: dict[tuple[str, str], list[bool]] = {}
    for r in rows:
        reached = (r.get("stats") or {}).get("budget_reached")
        if reached is not None:
            missed.setdefault((r["policy"], r["setting"]), []).append(not reached)
    return {policy for (policy, _), flags in missed.items() if 2 * sum(flags) > len(flags)}


def rank(folders: Sequence[str], ratios: Sequence[float] = (0.5, 0.75)) -> tuple[list[tuple[str, float]], dict[str, str]]:
    """(policy, mean score over `ratios`) best first, and the presets left out with the reason. A preset
    needs a complete setting at every ratio; the protocol comes from the rows (query_aware)."""
    rows = [r for f in folders for r in read_folder(f)[0]]
    aware = {bool(r.get("query_aware")) for r in rows}
    if len(aware) != 1:
        raise ValueError(f"{list(folders)}: expected the rows of one protocol, found query_aware in {sorted(aware)}")
    part = build_part("aware" if aware.pop() else "agnostic", folders, ratios, partial=True)
    left_out = {p: "its cache never came down to its budget" for p in never_reached(part.rows)}
    scores: dict[str, list[float]] = {}
    for (policy, label), s in part.statuses.items():
        if policy == paired.FULL or policy in left_out:
            continue
        if s.state != "complete" or s.paired is None or s.paired.score is None:
            left_out.setdefault(policy, f"{label} is {s.state}")
            continue
        scores.setdefault(policy, []).append(s.paired.score)
    ranked = [(p, sum(v) / len(v)) for p, v in scores.items() if p not in left_out and len(v) == len(ratios)]
    left_out.update({p: "a ratio without a complete setting" for p, v in scores.items()
                     if p not in left_out and len(v) != len(ratios)})
    ranked.sort(key=lambda pv: (-pv[1], pv[0]))
    return ranked, left_out


def seed(src: str | pathlib.Path, out: str | pathlib.Path, policies: Sequence[str]) -> int:
    """Copies `src`'s rows of `policies` and of the full cache into OUT/results.jsonl (rows already there
    are kept; the eval resumes past every seeded key). Returns the rows added."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / "results.jsonl"
    have = set()
    if dst.exists():
        have = {(r["task"], r["policy"], r["setting"], r["sample_id"]) for r in read_folder(out)[0]}
    keep = {paired.FULL, *policies}
    new = [r for r in read_folder(src)[0] if r["policy"] in keep
           and (r["task"], r["policy"], r["setting"], r["sample_id"]) not in have]
    with dst.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in new)
    return len(new)


def eval_command(src: str | pathlib.Path, out: str | pathlib.Path, policies: Sequence[str],
                 extra: Sequence[str]) -> list[str]:
    """`python -m kvjax.eval` with --from's run_config.json as its config (every sample-defining option as
    that run had it), `policies` and OUT; `extra` last (the command line wins over the config)."""
    return [sys.executable, "-m", "kvjax.eval", "--config", str(pathlib.Path(src) / "run_config.json"),
            "--policies", *policies, "--out", str(out), "--no-progress", *extra]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("best", "run"):
        p = sub.add_parser(name)
        p.add_argument("--from", dest="src", nargs="+", required=True, help="the finished protocol's run folders")
        p.add_argument("--n", type=int, required=True, help="how many of the best presets")
        if name == "run":
            p.add_argument("--out", required=True, help="the round's folder (resumable)")
            p.add_argument("--no-seed", action="store_true", help="do not copy --from's rows (new storages)")
            p.add_argument("--dry-run", action="store_true", help="print the eval command instead of running it")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n must be at least 1, got {args.n}")
    ranked, left_out = rank(args.src)
    best = [p for p, _ in ranked[:args.n]]
    if len(best) < args.n:
        ap.error(f"--n {args.n}: only {len(best)} presets have complete settings at every ratio in {args.src}")
    if args.cmd == "best":
        for p, score in ranked[:args.n]:
            print(f"{p}\t{score:.1f}")
        for p, why in sorted(left_out.items()):
            print(f"# left out: {p}: {why}", file=sys.stderr)
        return 0
    if not args.no_seed:
        print(f"seeded {seed(args.src[-1], args.out, best)} rows into {args.out}", file=sys.stderr)
    cmd = eval_command(args.src[-1], args.out, best, extra)
    print(" ".join(cmd), file=sys.stderr)
    return 0 if args.dry_run else subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
