"""`python -m kvjax.bench prefill` run from two checkouts alternately (old, new, old, new, ...), each run a
fresh process, so that the machine's load falls on both alike; writes a table of each program's median
over the runs, old beside new.

    python eval/prefill/before_after.py --rounds 2 --out eval/prefill/seams_before_after.md OLD_CHECKOUT NEW_CHECKOUT \
        -- --lengths 4096 16384 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

COLUMNS = ("kvjax prefill ms", "+ snapkv ms", "+ column mass ms")


def run(checkout: pathlib.Path, bench_args: list[str], out: pathlib.Path) -> dict[tuple[int, str], float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run([sys.executable, "-m", "kvjax.bench", "prefill", *bench_args, "--out", str(out)], cwd=checkout,
                   env=env, check=True, stdout=subprocess.DEVNULL)
    lines = [ln for ln in out.read_text().splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    times = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if not re.fullmatch(r"\d+", cells[0]):
            break
        for col in COLUMNS:
            times[(int(cells[0]), col)] = float(cells[header.index(col)])
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=pathlib.Path)
    p.add_argument("new", type=pathlib.Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    results: dict[str, list[dict[tuple[int, str], float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in ("old", "new"):
                checkout = getattr(args, name).resolve()
                results[name].append(run(checkout, bench_args, pathlib.Path(tmp) / f"{name}{r}.md"))
                print(f"round {r + 1} {name} done", flush=True)
    keys = sorted(results["old"][0])
    rows = ["| prompt tokens | program | before ms | after ms | after / before |", "|---|---|---:|---:|---:|"]
    for key in keys:
        old = statistics.median(t[key] for t in results["old"])
        new = statistics.median(t[key] for t in results["new"])
        rows.append(f"| {key[0]} | {key[1].removesuffix(' ms')} | {old:.0f} | {new:.0f} | {new / old:.3f}x |")
    text = "\n".join([
        "# Prefill before and after the forward-seams refactor", "",
        f"- before: `{args.old}`; after: `{args.new}`",
        f"- `python -m kvjax.bench prefill {' '.join(bench_args)}`, one fresh process per run, the two checkouts "
        f"alternating, {args.rounds} rounds; each cell is the median over the rounds of each run's own median",
        f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}", "", *rows, ""])
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
