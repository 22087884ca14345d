"""``python -m kvjax.bench ragged``: decode cache bytes and decode time, dense masked layout vs the
ragged layout (`kvjax.cache_ragged`), for budgets that vary by layer or by head.

The model is a random-weight Llama-family model of the size given by the options, so the numbers
are about cost, not quality. One prompt filling the bucket is prefilled and compressed once per
policy; the same compressed cache then decodes `--steps` tokens in the dense layout (capacity = the
largest kept count of any layer and head + room) and in the ragged one (per-layer capacities or
per-head segments sized to the kept counts, rounded up to the engine's granule, + room). The two
decodes run alternately on fresh copies of their caches (copying is not timed); "compile s" is the
first call's time minus the median (tracing the unrolled layers of the ragged step included).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies
from kvjax.bench._timing import emit, header_lines, markdown_table
from kvjax.bench.overhead import bench_config
from kvjax.cache_ragged import choose_layout
from kvjax.engine import api, make_plan, steps
from kvjax.models.export import init_params
from kvjax.sampling import Sampler

HELP = "decode cache bytes and ms/token of adaptive budgets: dense masked layout vs ragged layout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="pyramidkv,ada_snapkv,cake",
                        help="comma-separated presets (CAKE runs with decode=False: no decode-time eviction)")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens (one row filling the bucket)")
    parser.add_argument("--budget", type=int, default=128, help="entries kept per KV head (average)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per call")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median reported)")
    parser.add_argument("--note", default="", help="a line added to the report's header (e.g. machine load)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown report here")


def _policy(name: str):
    return policies.get(name, decode=False) if name.startswith("cake") else policies.get(name)


def run(args: argparse.Namespace) -> int:
    args.lengths = [args.length]
    cfg = bench_config(args)
    params = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), init_params(cfg, jax.random.PRNGKey(0)))
    T, B, S = args.length, args.batch, args.steps
    tokens = jnp.asarray(np.random.RandomState(T).randint(3, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    key = jax.random.PRNGKey(0)
    rows = []
    for name in [n for n in args.policies.split(",") if n]:
        policy = _policy(name)
        plan = make_plan(policy, np.full(B, T), cfg, budget=args.budget, compression_ratio=None, bucket=T, room=S,
                         question_tokens=0)
        first, cache, obs, _ = steps.prefill(params, tokens, positions, key, cfg=cfg, capacity=T,
                                             observe=steps.prefill_spec([policy]), rope_mode="original",
                                             sampler=Sampler(), mesh=None)
        dense, _ = steps.compress(cache, obs, plan, policy=policy, capacity=T + S, mesh=None)
        counts = np.asarray(jax.device_get(dense.num_valid()))
        layout = choose_layout(counts, S, api.RAGGED_GRANULE)
        ragged = steps.to_ragged(dense, layout=layout, room=S)
        kept_bytes = int(counts.sum()) * 2 * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize
        pos0 = jnp.full((B,), T, jnp.int32)

        def decode(c, first=first, pos0=pos0):
            return steps.decode(params, c, None, first, pos0, key, None, jnp.int32(S), cfg=cfg, steps=S, policy=None,
                                sampler=Sampler(), stop_ids=(), pad_id=0, mesh=None, rope_mode="original").tokens

        times: dict[str, list[float]] = {"dense": [], "ragged": []}
        compile_s = {}
        outs = {}
        for i in range(args.repeats + 1):
            for label, c in (("dense", dense), ("ragged", ragged)):
                fresh = jax.block_until_ready(jax.tree.map(jnp.copy, c))
                start = time.perf_counter()
                outs[label] = jax.block_until_ready(decode(fresh))
                elapsed = time.perf_counter() - start
                if i:
                    times[label].append(elapsed)
                else:  # the first call compiles
                    compile_s[label] = elapsed
        same = bool(np.array_equal(np.asarray(outs["dense"]), np.asarray(outs["ragged"])))
        kinds = "+".join(sorted({k for k, _ in layout}))
        base_bytes = dense.k.nbytes + dense.v.nbytes
        for label, c in (("dense", dense), ("ragged", ragged)):
            kv = (c.k.nbytes + c.v.nbytes) if label == "dense" else c.kv_nbytes()
            med = statistics.median(times[label])
            rows.append([name, label if label == "dense" else f"ragged ({kinds})", f"{kv / 2**20:.2f}",
                         f"{kv / base_bytes:.2f}", f"{(kv - kept_bytes) / 2**20:.2f}", med / (S - 1) * 1e3,
                         compile_s[label] - med, "yes" if same else "NO"])
            print(f"{name:12s} {label:7s} kv {kv / 2**20:8.2f} MiB  decode {med / (S - 1) * 1e3:8.3f} ms/token  "
                  f"compile {compile_s[label] - med:6.2f} s", flush=True)
    table = markdown_table(["policy", "layout", "KV MiB", "vs dense", "room+slack MiB", "decode ms/token",
                            "compile s", "same tokens"], rows)
    report = "\n".join([
        "# Dense masked vs ragged decode layout", "", *header_lines(),
        *([f"- {args.note}"] if args.note else []),
        (f"- model: random-weight Llama, {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads (head_dim {cfg.head_dim}), {cfg.dtype}; batch {B}"),
        (f"- prompt {T} tokens, budget {args.budget} per KV head (CAKE with decode=False); {S} decode steps per call "
        f"(room {S} per head); granule {api.RAGGED_GRANULE}; median of {args.repeats} runs, the layouts alternating"),
        ("- KV MiB: key and value buffers of the decode cache (positions and segment ids not counted); "
        "room+slack: what they hold beyond the kept entries (decode room, rounding, and the dense layout's "
        "padding up to the largest head)"), "", table, "",
        "Command: `python -m kvjax.bench ragged --out eval/ragged/ragged_decode_cpu.md`", ""])
    emit(report, args.out)
    return 0
