"""``python -m kvjax.bench``: subcommand discovery and the kernels table (tiny run, real timings)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.bench import __main__ as bench_main
from kvjax.bench import kernels as bench_kernels
from kvjax.kernels.attention.reference import attend


def test_subcommands_are_discovered():
    found = bench_main.subcommands()
    assert "kernels" in found
    assert all(not name.startswith("_") for name in found)


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in bench_main.subcommands()])
def test_every_help_prints(argv, capsys):
    """`python -m kvjax.bench [SUB] --help` prints its usage (a '%' in a help text once crashed it)."""
    with pytest.raises(SystemExit) as e:
        bench_main.main(argv)
    assert e.value.code == 0
    assert "usage: python -m kvjax.bench" in capsys.readouterr().out


def test_kernels_table(tmp_path, capsys, monkeypatch):
    # A smaller preset than "tiny" keeps the interpreter quick; the code path is the real one.
    monkeypatch.setitem(bench_kernels.SIZES, "tiny",
                        dict(b=1, hq=4, hkv=2, d=128, w=8, window=(256,), column=(256,), decode=(256,)))
    out = tmp_path / "table.md"
    assert bench_main.main(["kernels", "--sizes", "tiny", "--repeats", "1", "--impl", "interpret",
                            "--out", str(out)]) == 0
    text = out.read_text()
    assert "device: CPU" in text and "`interpret`" in text and "says nothing about TPU speed" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| op")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["window_scores", "column_mass", "decode_attention",
                                                     "prefill_attention"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[3]) > 0  # kernel ms, xla ms
        assert cells[6] == "n/a"  # no bandwidth fraction on CPU
    assert "kernel ms" in capsys.readouterr().out


def test_bad_ops_are_rejected():
    with pytest.raises(SystemExit, match="unknown"):
        bench_main.main(["kernels", "--ops", "flash"])


def test_prefill_attention_case_columns_agree():
    """The prefill-attention row times the attention op's default order against `flash_xla`: both columns
    compute the same causal attention (what makes the ratio a fair one)."""
    case = next(c for c in bench_kernels.build_cases("micro", ("prefill_attention",), jnp.float32))
    kernel, xla = (np.asarray(case.call(impl)(*case.args)) for impl in ("pallas_gpu", "xla"))
    q, k, v, qp, kp = case.args
    want, _ = attend(q, k, v, qp, kp, 1 / np.sqrt(q.shape[-1]))
    np.testing.assert_allclose(kernel, np.asarray(want), atol=2e-5)
    np.testing.assert_allclose(xla, np.asarray(want), atol=2e-5)
