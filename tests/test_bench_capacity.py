"""``python -m kvjax.bench capacity``: bytes per row from `kvjax.generate`, the batch that fits, the decode
timed at that batch (tiny model, real run)."""

import argparse

import jax
import numpy as np
import pytest

from kvjax.bench import __main__ as bench_main
from kvjax.bench import capacity
from kvjax.engine import generate

TINY = ["--context", "100", "--new-tokens", "4", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--layers", "1",
        "--vocab", "128", "--repeats", "1", "--no-progress"]


def _args(*argv):
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    return parser.parse_args([*TINY, *argv])


def test_capacity_batch_arithmetic_on_a_tiny_run(tmp_path, monkeypatch):
    out = tmp_path / "capacity.md"
    memory_gib = 0.002
    seen = {}
    measure = capacity.measure
    monkeypatch.setattr(capacity, "measure", lambda a: seen.setdefault("run", measure(a)))
    assert bench_main.main(["capacity", *TINY, "--memory-gib", str(memory_gib), "--policies", "snapkv",
                            "--compression-ratios", "0.5", "--kv-quant", "none,int8", "--max-measured-batch", "1",
                            "--out", str(out)]) == 0
    results, report = seen["run"]
    assert out.read_text() == report
    cells = {(r["policy"], r["setting"], r["kv_quant"]): r for r in results}
    assert set(cells) == {("full", "full", "none"), ("full", "full", "int8"), ("snapkv", "r=0.5", "none"),
                          ("snapkv", "r=0.5", "int8")}
    model = capacity.bench_model(_args())
    prompt = [1] + np.random.RandomState(100).randint(3, 128, 99).tolist()
    for (policy, _, storage), r in cells.items():  # bytes per row: kvjax.generate's own cache_bytes for the row
        direct = generate(model, [prompt], policy=None if policy == "full" else policy,
                          compression_ratio=None if policy == "full" else 0.5,
                          kv_quant=None if storage == "none" else storage, max_new_tokens=4, stop_tokens=[])
        assert r["bytes_per_row"] == direct.cache_bytes == sum(r["parts"].values())
        assert r["batch"] == int(memory_gib * 2**30) // r["bytes_per_row"] >= 1
        assert r["measured_batch"] == 1 and r["capped"] == (r["batch"] > 1) and r["tokens"] == "same"
        assert r["tokens_per_s"] > 0
    full, full8 = cells[("full", "full", "none")], cells[("full", "full", "int8")]
    snap, snap8 = cells[("snapkv", "r=0.5", "none")], cells[("snapkv", "r=0.5", "int8")]
    assert full8["bytes_per_row"] < full["bytes_per_row"] and snap8["bytes_per_row"] < snap["bytes_per_row"]
    assert snap["bytes_per_row"] < full["bytes_per_row"]
    assert full["ratio"] == 1.0 and full8["ratio"] == full8["batch"] / full["batch"] > 1
    assert full8["parts"]["scales"] > 0 and full["parts"]["scales"] == 0 and full["parts"]["window"] == 0
    table = [ln for ln in report.splitlines() if ln.startswith("| full | full | int8 |")]
    assert len(table) == 1 and f"| {full8['batch']} | {full8['ratio']:.2f} | 1 (capped) |" in table[0]
    assert "Command: `python -m kvjax.bench capacity --memory-gib 0.002" in report


def test_the_decode_is_timed_on_the_row_repeated_to_the_batch():
    args = _args("--policies", "none", "--kv-quant", "none")
    model = capacity.bench_model(args)
    prompt = [1] + list(range(3, 102))
    (st,) = capacity.make_settings(args)
    tokens, positions = (np.array([prompt + [0] * 28], np.int32), np.array([list(range(100)) + [-1] * 28], np.int32))
    from kvjax.engine import steps
    from kvjax.sampling import Sampler

    first, cache, obs, _ = steps.prefill(model.params, tokens, positions, jax.random.PRNGKey(0), cfg=model.config,
                                         capacity=128, observe=steps.prefill_spec([None]), rope_mode="original",
                                         sampler=Sampler(), mesh=None)
    first, row = capacity.row_cache(model, st, {"length": 100, "original": (first, cache, obs)}, bucket=128, room=16)
    big = capacity.repeat_rows(row, 3)
    assert big.nbytes() == 3 * row.nbytes() and big.k.shape[1] == 3
    seconds, got = capacity.time_decode(model, first, row, batch=3, length=100, new_tokens=4, repeats=1)
    direct = generate(model, [prompt], max_new_tokens=4, stop_tokens=[])
    assert seconds > 0 and got.shape == (3, 4) and (got == direct.tokens[0]).all()
    check = lambda tokens: capacity.token_check(model, first, row, tokens, direct.tokens[0], length=100,  # noqa: E731
                                                new_tokens=4)
    assert check(got) == "same"
    parted = got.copy()
    parted[:, 2] += 1  # every row parts from generate's tokens at token 2: the batch-1 decode decides
    assert check(parted) == "same at batch 1 (batch 3 from token 2)"
    parted[1, 3] += 1  # rows that disagree with each other
    assert check(parted) == "NO"


def test_capacity_options_are_checked_by_name(capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["capacity", "--kv-quant", "none,int3"])
    assert "--kv-quant: unknown storage(s) 'int3'; accepted: none, int8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main.main(["capacity", "--max-measured-batch", "-2"])
    assert "--max-measured-batch takes 'auto', 'none' or a count" in capsys.readouterr().err
    for argv, message in ((["--policies", "h2o"], "--policies: 'h2o' evicts while decoding"),
                          (["--memory-gib", "0"], "--memory-gib must be positive"),
                          (["--compression-ratios", "1.0"], "--compression-ratios: 1.0 is not in [0, 1)")):
        with pytest.raises(SystemExit, match="error: " + message.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)").replace("]", r"\]")):
            bench_main.main(["capacity", *argv])
    assert capacity.measured_cap("auto") == (capacity.CPU_MEASURED_BATCH if jax.default_backend() == "cpu" else None)
    assert capacity.measured_cap("none") is None and capacity.measured_cap(5) == 5
    assert "capacity" in bench_main.subcommands()
