"""``python -m kvjax.bench select``: the selection primitive's cost, side by side in one run: the kept set
at a count (half the slots) by `rank` (a stable sort, its permutation inverted by a second sort or by a
scatter) and by `select` (`first_in_order`: bisection on the keys, no sort).

Every prefill policy selects on its scores (`kvjax.policies.base.select`, per head); Ada-KV selects a second
time over each layer's heads together. Shapes are a cache's [L, B, Hkv, C] (per head) and [L, B, Hkv * C]
(per layer), scores with ties as pooled scores have them.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench._timing import emit, header_lines, markdown_table, median_seconds
from kvjax.policies.base import rank, select

HELP = "the kept set at a count: by rank (sort, inverted by a sort or a scatter) and by select's bisection"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--lengths", default="2048,8192", type=lambda s: [int(x) for x in s.split(",")],
                        help="cache slots per head")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per cell (median reported)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown report here")


def run(args: argparse.Namespace) -> int:
    rows = []
    for C in args.lengths:
        shape = (args.layers, args.batch, args.kv_heads, C)
        rng = np.random.RandomState(C)
        scores = jnp.asarray(np.round(rng.rand(*shape) * 64) / 64, jnp.float32)  # ties, as max pooling makes
        pos = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), shape)
        for layout, s, p in (("per head", scores, pos),
                             ("per layer", scores.reshape(shape[0], shape[1], -1), pos.reshape(shape[0], shape[1], -1))):
            count = s.shape[-1] // 2
            ways = {"sort": lambda s, p: rank(s, p >= 0, pos=p, invert_by="sort") < count,
                    "scatter": lambda s, p: rank(s, p >= 0, pos=p, invert_by="scatter") < count,
                    "bisection": lambda s, p: select(s, p >= 0, count, pos=p)}
            ms, kept = {}, {}
            for name, fn in ways.items():
                fn = jax.jit(fn)
                ms[name] = median_seconds(fn, (s, p), args.repeats) * 1e3
                kept[name] = fn(s, p)
            if not all(bool(jnp.all(k == kept["sort"])) for k in kept.values()):
                raise RuntimeError(f"selection of {list(s.shape)} ({layout}): the three ways disagree")
            rows.append([f"{list(s.shape)}", layout, ms["sort"], ms["scatter"], ms["bisection"],
                         ms["sort"] / ms["bisection"]])
            print(f"{str(list(s.shape)):22s} {layout:9s} " + "  ".join(f"{k} {v:8.2f} ms" for k, v in ms.items()),
                  flush=True)
    table = markdown_table(["scores", "selection", "rank, inverted by a sort (ms)", "rank, inverted by a scatter (ms)",
                            "select by bisection (ms)", "sort / bisection"], rows)
    report = "\n".join(["# Selection: the kept set at half the slots", "", *header_lines(),
                        f"- median of {args.repeats} runs after a compile run; the three give the same kept set "
                        "(checked)", "", table, ""])
    emit(report, args.out)
    return 0
