"""``python -m kvjax.bench select``: the selection primitive's cost, its permutation inverted by a scatter
against a second sort, side by side in one run.

Every prefill policy ranks its scores (`kvjax.policies.base.rank`, one stable sort per head and its inverse);
Ada-KV ranks a second time over each layer's heads together. Shapes are a cache's [L, B, Hkv, C] (per head)
and [L, B, Hkv * C] (per layer), scores with ties as pooled scores have them.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench._timing import emit, header_lines, markdown_table, median_seconds
from kvjax.policies.base import INVERSIONS, rank

HELP = "rank (the selection sort) with its permutation inverted by a scatter and by a sort, and their ratio"


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
            ms = {}
            for by in INVERSIONS:
                fn = jax.jit(lambda s, p, by=by: rank(s, p >= 0, pos=p, invert_by=by))
                ms[by] = median_seconds(fn, (s, p), args.repeats) * 1e3
            by_scatter, by_sort = (rank(s, p >= 0, pos=p, invert_by=by) for by in ("scatter", "sort"))
            if not bool(jnp.all(by_scatter == by_sort)):
                raise RuntimeError(f"rank of {list(s.shape)} ({layout}): the two inversions disagree")
            rows.append([f"{list(s.shape)}", layout, ms["sort"], ms["scatter"], ms["sort"] / ms["scatter"]])
            print(f"{str(list(s.shape)):22s} {layout:9s} sort {ms['sort']:8.2f} ms  scatter {ms['scatter']:8.2f} ms",
                  flush=True)
    table = markdown_table(["scores", "rank", "inverted by a sort (ms)", "inverted by a scatter (ms)", "ratio"], rows)
    report = "\n".join(["# Selection: rank's inverse permutation", "", *header_lines(),
                        f"- median of {args.repeats} runs after a compile run; both give the same ranks (checked)",
                        "", table, ""])
    emit(report, args.out)
    return 0
