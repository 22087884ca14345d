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
                              "--intermediate", "48",
                              "--lookahead-option", "n_tokens=4", "--lookahead-option", "window=8",
                              "--lookahead-members", "2", "--out", str(tmp_path / "r.md")])
    assert overhead.run(args) == 0
    report = (tmp_path / "r.md").read_text()
    assert "- LookaheadKV adapter: 4 tokens x 2 members, options n_tokens=4 window=8" in report
    assert "width 32 (MLP 48)" in report  # --intermediate
    row = next(line for line in report.splitlines() if line.startswith("| lookahead_kv"))
    cells = row.split("|")
    assert "not run" not in row and float(cells[5]) > 0 and float(cells[6]) > 0  # ratios of measured prefills
    full, alone, ratio = float(cells[3]), float(cells[8]), float(cells[9])
    assert alone > 0 and abs(ratio - (1 + alone / full)) < 1e-3 * ratio  # the passes, scoring and compaction alone
    inside, whole = float(cells[10]), float(cells[11])  # window=8: the window's attention is recorded inside
    assert abs(whole - (1 + (inside + alone) / full)) < 1e-3 * whole
    with pytest.raises(SystemExit, match="lookahead-members must be >= 1"):
        overhead.run(parser.parse_args(["--lookahead-members", "0"]))


def test_recording_inside_the_prefill_is_timed_for_a_policy_that_records(tmp_path, monkeypatch):
    """snapkv records its window's attention inside the prefill, and lookahead_kv's tokens ride it: for each a
    third program, the recording prefill, is timed in the same rounds and its median paired difference from the
    full prefill enters the whole overhead. With --separate-passes lookahead_kv's prefill is the full one (its
    tokens run after it), so only two programs run for it."""
    timed = []
    real = overhead.alternating_times

    def counting(fns, repeats):
        timed.append(len(fns))
        return real(fns, repeats)

    monkeypatch.setattr(overhead, "alternating_times", counting)
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    common = ["--lengths", "256", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--layers", "1", "--vocab",
              "64", "--repeats", "2", "--lookahead-option", "n_tokens=4"]
    args = parser.parse_args(["--policies", "snapkv,lookahead_kv", *common, "--out", str(tmp_path / "r.md")])
    assert overhead.run(args) == 0
    assert timed == [3, 3]
    report = (tmp_path / "r.md").read_text()
    assert "- model: random-weight Llama, 1 layers, width 32 (MLP 128), vocabulary 64" in report
    assert "its tokens ride the prefill" in report
    for name in ("snapkv", "lookahead_kv"):
        cells = next(line for line in report.splitlines() if line.startswith(f"| {name} ")).split("|")
        full, alone, inside, whole = (float(cells[i]) for i in (3, 8, 10, 11))
        assert inside != 0 and abs(whole - (1 + (inside + alone) / full)) < 1e-3 * whole
    timed.clear()
    args = parser.parse_args(["--policies", "lookahead_kv", *common, "--separate-passes", "--out",
                              str(tmp_path / "s.md")])
    assert overhead.run(args) == 0
    assert timed == [2]
    report = (tmp_path / "s.md").read_text()
    assert "its tokens run in a pass after the prefill (--separate-passes)" in report
    cells = next(line for line in report.splitlines() if line.startswith("| lookahead_kv ")).split("|")
    assert float(cells[10]) == 0 and float(cells[11]) == float(cells[9])  # its prefill is the full one


def test_compare_riding_times_the_prefill_without_the_rows_and_their_pass_after(tmp_path, monkeypatch):
    """--compare-riding: for lookahead_kv, two more programs in the same rounds (the prefill without its riding
    rows, and their pass after it) and two more columns; snapkv, whose prefill has nothing riding, reads n/a."""
    timed = []
    real = overhead.alternating_times
    monkeypatch.setattr(overhead, "alternating_times", lambda fns, repeats: timed.append(len(fns)) or real(fns, repeats))
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    args = parser.parse_args(["--policies", "snapkv,lookahead_kv", "--lengths", "128", "--hidden", "32", "--heads", "4",
                              "--kv-heads", "2", "--layers", "1", "--vocab", "64", "--repeats", "2",
                              "--lookahead-option", "n_tokens=4", "--compare-riding", "--out", str(tmp_path / "r.md")])
    assert overhead.run(args) == 0
    assert timed == [3, 5]
    report = (tmp_path / "r.md").read_text().splitlines()
    header = next(line for line in report if line.startswith("| policy")).split("|")
    assert header[-3:-1] == [" riding rows inside the prefill (ms) ", " their pass after the prefill (ms) "]
    snap = next(line for line in report if line.startswith("| snapkv ")).split("|")
    assert [c.strip() for c in snap[-3:-1]] == ["n/a", "n/a"]
    look = next(line for line in report if line.startswith("| lookahead_kv ")).split("|")
    assert len(look) == len(header) and float(look[-2]) > 0  # the pass after the prefill takes time
    float(look[-3])  # a paired difference: a number (of either sign on a noisy machine)


def test_alternating_times_runs_each_function_in_turn():
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times = overhead.alternating_times(fns, 3)
    # a compile run each, then rounds in turn, each starting one function later (no fixed first or last)
    assert calls[:3] == [0, 1, 2] and calls[3:] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert [len(t) for t in times] == [3, 3, 3] and all(x >= 0 for t in times for x in t)
