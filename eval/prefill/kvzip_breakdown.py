"""Where KVzip's prefill time goes, in one process (the bench model of `python -m kvjax.bench overhead`):
the plain prefill, the repeat passes' `extend` alone (every chunk, no scoring), and the scoring of their
queries alone, blocked (`subsampled_column_max`) beside the materialised probabilities over every cache slot
(the path it replaced), alternating, median of N.

    PYTHONPATH=. python eval/prefill/kvzip_breakdown.py --lengths 4096 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies
from kvjax.bench.overhead import bench_config
from kvjax.engine import steps
from kvjax.models.export import init_params
from kvjax.models.forward import extend
from kvjax.observations import ObservationSpec
from kvjax.passes.reconstruction import (
    _chunk_max_materialized,
    chunk_bounds,
    pass_inputs,
    subsampled_column_max,
)
from kvjax.sampling import Sampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ns = argparse.Namespace(vocab=2048, hidden=256, layers=2, heads=8, kv_heads=2, dtype="float32", lengths=args.lengths)
    cfg = bench_config(ns)
    params = init_params(cfg, jax.random.PRNGKey(0))
    spec = policies.get("kvzip").reconstruction()
    scale = cfg.head_dim ** -0.5
    print("| prompt tokens | prefill ms | passes (extend) ms | scoring blocked ms | scoring materialised ms |"
          " passes / prefill | blocked / prefill | materialised / prefill |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for T in args.lengths:
        tokens = jnp.asarray(np.random.RandomState(T).randint(3, cfg.vocab_size, (1, T)), jnp.int32)
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        key = jax.random.PRNGKey(0)

        def prefill():
            return steps.prefill(params, tokens, positions, key, cfg=cfg, capacity=T, observe=steps.prefill_spec([None]),
                                 rope_mode="original", sampler=Sampler(), mesh=None)

        cache = prefill()[1]
        lengths = jnp.asarray([T], jnp.int32)
        bounds = chunk_bounds(spec, T)

        @jax.jit
        def passes(cache):
            out = []
            for i, (start, end) in enumerate(bounds):
                ids, pos = pass_inputs(spec, tokens, lengths, i, start, end)
                n = ids.shape[1]
                L, B, Hkv = cache.k.shape[:3]
                slots = jnp.broadcast_to(T + jnp.arange(n, dtype=jnp.int32), (L, B, Hkv, n))
                _, grown, obs = extend(params, cfg, cache.grow(T + n), ids, pos, fresh=False, slots=slots,
                                       observe=ObservationSpec(window=n), logit_index=jnp.zeros((B, 1), jnp.int32))
                out.append((obs.window_queries, obs.window_positions, grown))
            return out

        recorded = passes(cache)

        @jax.jit
        def blocked(recorded):
            outs = []
            for (start, end), (q, qpos, grown) in zip(bounds, recorded):
                sink = min(spec.n_sink, start)
                kpos = jnp.where(grown.valid, grown.pos, -1)
                ctx = jnp.concatenate([grown.k[:, :, :, :sink], grown.k[:, :, :, start:end]], axis=3)
                cpos = jnp.concatenate([kpos[..., :sink], kpos[..., start:end]], axis=-1)
                outs.append(jax.lax.map(lambda xs: subsampled_column_max(xs[0], qpos, *xs[1:], scale=scale),
                                        (q, ctx, cpos, grown.k[:, :, :, T:], kpos[..., T:])))
            return outs

        @jax.jit
        def materialized(recorded):
            return [_chunk_max_materialized(q, qpos, grown, lengths, start, end, spec.n_sink, scale)
                    for (start, end), (q, qpos, grown) in zip(bounds, recorded)]

        fns = [prefill, lambda: passes(cache), lambda: blocked(recorded), lambda: materialized(recorded)]
        for fn in fns:
            jax.block_until_ready(fn())
        times = [[] for _ in fns]
        for _ in range(args.repeats):
            for fn, t in zip(fns, times):
                start = time.perf_counter()
                jax.block_until_ready(fn())
                t.append(time.perf_counter() - start)
        pre, ext, blk, mat = (statistics.median(t) * 1e3 for t in times)
        print(f"| {T} | {pre:.0f} | {ext:.0f} | {blk:.0f} | {mat:.0f} | {ext / pre:.2f}x | {blk / pre:.2f}x | "
              f"{mat / pre:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
