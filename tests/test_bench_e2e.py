"""``python -m kvjax.bench e2e`` at toy size: the worker processes, the report, and the kvjax side's
tokens equal `kvjax.generate`'s. The kvpress side runs when $KVPRESS_PYTHON names a Python that imports
kvpress (e.g. a venv with kvpress 0.5.x); otherwise it is skipped, as the bench does."""

from __future__ import annotations

import argparse
import os

from kvjax.bench import __main__ as bench_main
from kvjax.bench import _e2e_kvjax, e2e
from kvjax.models import load_model

TOY = ["--context-tokens", "80", "--question-tokens", "8", "--new-tokens", "4", "--hidden", "64", "--layers", "2",
       "--heads", "4", "--kv-heads", "2", "--vocab", "256", "--repeats", "1"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(argv)


def test_e2e_registered():
    assert "e2e" in bench_main.subcommands()


def test_kvpress_missing_is_skipped_cleanly(tmp_path):
    assert "no --kvpress-python" in e2e.kvpress_available(None)
    assert "could not be run" in e2e.kvpress_available(str(tmp_path / "no-python"))


def test_e2e_toy(tmp_path, capsys):
    python = os.environ.get("KVPRESS_PYTHON")
    args = parse([*TOY, "--workdir", str(tmp_path), "--out", str(tmp_path / "e2e.md"), "--note", "toy run",
                  *(["--kvpress-python", python] if python else [])])
    res = e2e.measure(args, tmp_path)
    # the kvjax worker's answer is kvjax.generate's, here in this process on the same checkpoint and request
    request = res["inputs"]["request"]
    expected = _e2e_kvjax.generate_tokens(load_model(tmp_path / "model", dtype="float32", tokenizer=False), request)
    assert len(expected) == 4 and res["tokens"]["kvjax"] == expected
    assert res["tokens_stable"]
    assert set(res["cold"]) >= {"kvjax", "kvjax, warm cache"}
    assert all(c["first_s"] > 0 and c["total_s"] >= c["first_s"] for c in res["cold"].values())
    assert any(tmp_path.joinpath("jax-cache").iterdir())  # the first kvjax process wrote the compilation cache
    text = e2e.report(args, res, "n/a")
    assert "**toy run**" in text and "| warm: whole request (median of 1) |" in text
    if res["kvpress_skipped"]:
        assert "kvpress side skipped" in capsys.readouterr().out and "not checked" in text
    else:  # float32, same weights: SnapKV under kvpress's semantics picks the same entries, same greedy answer
        assert res["tokens"]["kvpress"] == expected and "identical" in text
