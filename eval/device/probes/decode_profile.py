"""Probe: where a decode step's time goes (the device check's launch-bound decode).

The H200 decodes the device bench's 1.1B model at 3-4 ms per token where its weights and an 8K cache take
about 0.5 ms to read, and neither XLA's dynamic-slice fusion nor wider command buffers move it. This traces
two `kvjax.generate` calls that differ only in the number of decoded tokens (`--short`, `--long`, one
compiled loop: decode_tokens = --long) with `jax.profiler`, reads the traces back with
`jax.profiler.ProfileData`, and reports per decoded token (the difference of the two traces over the
extra tokens): the device's kernels (count, summed busy time), the wall time, and the kernels that take
the most time, each with its count per token.

    python eval/device/probes/decode_profile.py [--tiny] [--prompt N] [--policy snapkv] [--out FILE.json]

Kernels launched from a CUDA graph do not appear on the GPU's stream lines: with the engine's decode in graphs
(its while loop included, `kvjax.engine.steps.DECODE_COMPILER_OPTIONS`) the kernel rows read 0 and only the
wall time counts; `XLA_FLAGS=--xla_gpu_enable_command_buffer=` shows the kernels. `--split-layers` splits the
params per layer before the call (the layer loop the engine runs on GPUs, on any backend).

On a CPU (or with --tiny) it runs the tiny sizes; the CPU trace has no device plane, so the rows are the
host's XLA thunks (the PjRt client's threads).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import pathlib
import tempfile
import time
from typing import Any

import jax

from kvjax import generate
from kvjax.models.model import Model
from kvjax.models.forward import split_layers
from kvjax.bench.device import SIZES, build_model, prompt_ids


def kernel_events(trace_dir: str) -> tuple[list[tuple[str, int, int]], str]:
    """(name, start ns, duration ns) of every event on the device planes' stream lines (GPU kernels and
    copies; on a TPU, its ops lines), and which plane and lines they came from."""
    paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not paths:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(paths[-1])
    events, where, seen = [], [], {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            seen[f"{plane.name}:{line.name}"] = len(list(line.events))
            # GPU: "Stream #N(...)" lines hold the kernels (the "XLA Ops" / "XLA Modules" lines are derived
            # from them); TPU: "XLA Ops"
            if line.name.startswith("Stream") or (line.name == "XLA Ops" and "TPU" in plane.name):
                where.append(f"{plane.name}:{line.name}")
                events += [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events]
    if not events:  # a CPU: XLA's thunks run on the PjRt client's threads, beside its own bookkeeping events
        for plane in data.planes:
            for line in plane.lines if plane.name == "/host:CPU" else ():
                if line.name.startswith("tf_XLAPjRtCpuClient"):
                    where.append(f"{plane.name}:{line.name}")
                    events += [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events
                               if not e.name.startswith(("ThreadpoolListener", "end: "))]
    return events, "; ".join(where) or f"no device kernel lines (device lines: {seen})"


def trace_call(fn, trace_dir: str) -> tuple[float, list[tuple[str, int, int]], str]:
    with jax.profiler.trace(trace_dir):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        wall = time.perf_counter() - start
    events, where = kernel_events(trace_dir)
    return wall, events, where


def per_token(short: list, long: list, extra: int) -> dict[str, Any]:
    """The long trace minus the short one, over `extra` tokens: kernels and busy ms per token, and the
    kernels by summed time (count and ms per token)."""
    def by_name(events):
        count, ns = collections.Counter(), collections.Counter()
        for name, _, dur in events:
            count[name] += 1
            ns[name] += dur
        return count, ns

    cs, ns_s = by_name(short)
    cl, ns_l = by_name(long)
    top = sorted(((n, (cl[n] - cs[n]) / extra, (ns_l[n] - ns_s[n]) / extra / 1e6) for n in cl),
                 key=lambda r: -r[2])
    return {"kernels_per_token": (len(long) - len(short)) / extra,
            "busy_ms_per_token": (sum(ns_l.values()) - sum(ns_s.values())) / extra / 1e6,
            "top": [dict(name=n[:120], per_token=c, ms_per_token=ms) for n, c, ms in top[:25]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--prompt", type=int, default=8192, help="prompt tokens (full sizes)")
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=80)
    p.add_argument("--policy", help="a preset at compression_ratio 0.5 (default: the full cache)")
    p.add_argument("--split-layers", action="store_true",
                   help="params split per layer once (`split_layers`): the layers run in a Python loop, no scan")
    p.add_argument("--out")
    args = p.parse_args(argv)
    tiny = args.tiny or jax.default_backend() == "cpu"
    sz = dict(SIZES["tiny" if tiny else "full"])
    length = 256 if tiny else args.prompt
    sz["context_cap"] = length + args.long
    model = build_model(sz)
    if args.split_layers:
        model = Model(config=model.config, params=split_layers(model.params))
    prompt = prompt_ids(length, sz["vocab"])
    kw = dict(policy=args.policy, compression_ratio=0.5) if args.policy else {}

    def gen(n: int):
        return generate(model, [prompt], max_new_tokens=n, decode_tokens=args.long, stop_tokens=[], **kw).tokens

    for n in (args.short, args.long):  # compile, then once more warm
        jax.block_until_ready(gen(n))
        jax.block_until_ready(gen(n))
    with tempfile.TemporaryDirectory() as tmp:
        wall_s, ev_s, where = trace_call(lambda: gen(args.short), f"{tmp}/short")
        wall_l, ev_l, _ = trace_call(lambda: gen(args.long), f"{tmp}/long")
    extra = args.long - args.short
    row = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "prompt": length,
           "setting": (args.policy or "full") + (" split_layers" if args.split_layers else ""), "short": args.short, "long": args.long, "lines": where,
           "wall_ms_per_token": (wall_l - wall_s) / extra * 1e3, **per_token(ev_s, ev_l, extra)}
    row["busy_fraction"] = row["busy_ms_per_token"] / row["wall_ms_per_token"] if row["wall_ms_per_token"] > 0 else None
    print(f"{row['setting']} at {length} tokens on {row['device']}: {row['wall_ms_per_token']:.2f} ms per token "
          f"(traced), {row['kernels_per_token']:.0f} kernels per token, {row['busy_ms_per_token']:.2f} ms busy")
    for t in row["top"][:15]:
        print(f"  {t['ms_per_token']:7.3f} ms  x{t['per_token']:6.1f}  {t['name']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
