"""`python -m kvjax.bench overhead`: the fresh LookaheadKV adapter it times is the one its options describe."""

import argparse

import pytest

from kvjax.bench import overhead
from kvjax.lookahead import LookaheadConfig


def test_lookahead_options_build_the_adapter_config():
    conf = overhead.lookahead_config(["n_tokens=8", "window=32", "tail=45", "tail_weight=0.5", "pooling=none"])
    assert conf == LookaheadConfig(n_tokens=8, window=32, tail=45, tail_weight=0.5, pooling=None)
    assert isinstance(conf.window, int) and overhead.lookahead_config([]) == LookaheadConfig()
    for bad, says in (("size=3", "NAME one of"), ("window", "NAME=VALUE"), ("kernel=4", "kernel must be odd"),
                      ("window_weight=0", "window_weight must be a positive float")):
        with pytest.raises(SystemExit, match=says):
            overhead.lookahead_config([bad])


def test_report_names_the_timed_adapter(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    args = parser.parse_args(["--policies", "lookahead_kv", "--lengths", "64", "--hidden", "32", "--heads", "4",
                              "--kv-heads", "2", "--layers", "1", "--vocab", "64", "--repeats", "1",
                              "--lookahead-option", "n_tokens=4", "--lookahead-option", "window=8",
                              "--lookahead-members", "2", "--out", str(tmp_path / "r.md")])
    assert overhead.run(args) == 0
    report = (tmp_path / "r.md").read_text()
    assert "- LookaheadKV adapter: 4 tokens x 2 members, options n_tokens=4 window=8" in report
    row = next(line for line in report.splitlines() if line.startswith("| lookahead_kv"))
    cells = row.split("|")
    assert "not run" not in row and float(cells[5]) > 0 and float(cells[6]) > 0  # ratios of measured prefills
    full, alone, ratio = float(cells[3]), float(cells[8]), float(cells[9])
    assert alone > 0 and abs(ratio - (1 + alone / full)) < 1e-3 * ratio  # the passes, scoring and compaction alone
    with pytest.raises(SystemExit, match="lookahead-members must be >= 1"):
        overhead.run(parser.parse_args(["--lookahead-members", "0"]))
