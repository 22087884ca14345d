"""`python -m kvjax.bench select`: rank (both inversions) and select's bisection timed on the shapes asked for."""

import argparse

from kvjax.bench import __main__ as bench_main
from kvjax.bench import select


def test_report_times_the_three_selections_per_head_and_per_layer(tmp_path):
    assert "select" in bench_main.subcommands()
    parser = argparse.ArgumentParser()
    select.add_arguments(parser)
    args = parser.parse_args(["--layers", "2", "--kv-heads", "3", "--lengths", "40", "--repeats", "1",
                              "--out", str(tmp_path / "r.md")])
    assert select.run(args) == 0
    rows = [line.split("|") for line in (tmp_path / "r.md").read_text().splitlines() if line.startswith("| [")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("[2, 1, 3, 40]", "per head"), ("[2, 1, 120]", "per layer")]
    for r in rows:
        sort_ms, scatter_ms, bisection_ms, ratio = (float(x) for x in r[3:7])
        assert min(sort_ms, scatter_ms, bisection_ms) > 0 and abs(ratio - sort_ms / bisection_ms) < 3e-3 * ratio
