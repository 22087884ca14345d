"""Training throughput of a LookaheadKV recipe on this machine: target records and train steps per second.

    python -m train_lookahead.throughput --config configs/lookahead_smollm2_ood.yaml [--chunks 2] [--steps 6] \\
        [--prompt-cache config|on|off|both] [--workdir DIR] [--out FILE.md]

Runs the recipe's own pipeline on a slice of its first data source, in a temporary workdir (nothing is
exported to the config's run): the targets stage once on one chunk of `targets.batch_size` prompts (its
programs compile) and again on `--chunks` chunks with the programs compiled, then `--steps` train steps
(the first compiles; checkpoints only at the end, after the timed steps). Reports seconds per target
chunk and prompts per second, the first step and the median of the other steps, steps and examples per
second, the device and the config's sizes. The numbers are the machine's at the config's shapes: on a
shared machine they are an upper bound of the time. `--prompt-cache both` measures the recipe without and
with `targets.prompt_cache` one after the other in the same process (a row each, and their ratio).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax

from train_lookahead.config import RunConfig
from train_lookahead.pipeline import build_mesh, load_frozen, run
from train_lookahead.targets import generate_targets


def _slice(cfg: RunConfig, prompts: int, steps: int) -> RunConfig:
    """`cfg` with its first source cut to `prompts` prompts, `steps` train steps, one log row per step and
    a checkpoint only at the end."""
    source = dataclasses.replace(cfg.data.sources[0], num_samples=prompts)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=(source,)),
                               train=dataclasses.replace(cfg.train, steps=steps, checkpoint_every=steps + 1,
                                                         log_every=1))


def measure(cfg: RunConfig, workdir: str | pathlib.Path, *, chunks: int = 2, steps: int = 6) -> dict[str, Any]:
    """The throughput numbers of `cfg` (module doc), from runs in subfolders of `workdir`."""
    if chunks < 1 or steps < 2:
        raise ValueError(f"need chunks >= 1 and steps >= 2 (a compile step and a timed one), got {chunks}, {steps}")
    workdir = pathlib.Path(workdir)
    per_chunk = cfg.targets.batch_size
    model = load_frozen(cfg.model, build_mesh(cfg.mesh))
    t0 = time.perf_counter()
    generate_targets(model, _slice(cfg, per_chunk, steps).data, cfg.targets, workdir / "compile", progress=False)
    first_chunk = time.perf_counter() - t0
    timed = _slice(cfg, chunks * per_chunk, steps)
    t0 = time.perf_counter()
    generate_targets(model, timed.data, cfg.targets, workdir / "timed", progress=False)
    chunk_s = (time.perf_counter() - t0) / chunks
    stamps = [time.perf_counter()]
    run(timed, workdir / "timed", progress=False, on_step=lambda step, row: stamps.append(time.perf_counter()))
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    if len(step_s) != steps:
        raise RuntimeError(f"expected {steps} train steps, saw {len(step_s)}")
    # the last step also writes the checkpoint: the median is over steps 2 .. steps-1 when there are any
    warm = step_s[1:-1] or step_s[1:]
    median = statistics.median(warm)
    return {
        "device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}), {jax.device_count()} device(s)",
        "model": str(cfg.model.path), "max_prompt_tokens": cfg.data.max_prompt_tokens,
        "max_response_tokens": cfg.targets.max_response_tokens, "lookahead_tokens": cfg.lookahead.n_tokens,
        "targets_batch": per_chunk, "train_batch": cfg.train.batch_size, "targets_mode": cfg.targets.mode,
        "prompt_cache": cfg.targets.prompt_cache,
        "first_chunk_s": first_chunk, "chunk_s": chunk_s, "prompts_per_s": per_chunk / chunk_s,
        "chunks": chunks, "first_step_s": step_s[0], "step_s": median, "steps_per_s": 1.0 / median,
        "examples_per_s": cfg.train.batch_size / median, "timed_steps": len(warm),
    }


def report(runs: Sequence[dict[str, Any]], config: str, note: str = "") -> str:
    """Markdown of `measure`'s numbers: one pair of rows (targets, train) per run, and with two runs that
    differ in `targets.prompt_cache` the ratio of their steady train steps."""
    m = runs[0]
    lines = [f"# LookaheadKV training throughput: `{config}`", "",
             f"- device: {m['device']}; jax {jax.__version__}" + (f"; {note}" if note else ""),
             f"- model {m['model']}; prompts padded to {m['max_prompt_tokens']} tokens, responses up to "
             f"{m['max_response_tokens']}, {m['lookahead_tokens']} lookahead tokens; targets mode {m['targets_mode']}",
             "", "| prompt cache | stage | first (compile + run) s | steady s | rate |", "|---|---|---:|---:|---|"]
    for m in runs:
        cache = "stored" if m.get("prompt_cache") else "prefilled each step"
        lines += [
            f"| {cache} | targets: one chunk of {m['targets_batch']} prompts | {m['first_chunk_s']:.1f} | "
            f"{m['chunk_s']:.1f} (mean of {m['chunks']}) | {m['prompts_per_s']:.3f} prompts/s |",
            f"| {cache} | train: one step of {m['train_batch']} examples (first: the frozen model reloaded, the step "
            f"compiled) | {m['first_step_s']:.1f} | {m['step_s']:.2f} (median of {m['timed_steps']}) | "
            f"{m['steps_per_s']:.4f} steps/s, {m['examples_per_s']:.3f} examples/s |"]
    by_cache = {bool(m.get("prompt_cache")): m for m in runs}
    if len(by_cache) == 2:
        lines += ["", f"A train step with the stored prompt cache takes {by_cache[True]['step_s']:.2f} s against "
                  f"{by_cache[False]['step_s']:.2f} s prefilling: **{by_cache[False]['step_s'] / by_cache[True]['step_s']:.1f}x** "
                  f"faster; its target chunks {by_cache[True]['chunk_s'] / by_cache[False]['chunk_s']:.2f}x the time "
                  "(the cache is written to disk too)."]
    return "\n".join(lines + [""])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train_lookahead.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a YAML run config (configs/lookahead_*.yaml)")
    p.add_argument("--chunks", type=int, default=2, help="target chunks timed after the compile chunk")
    p.add_argument("--steps", type=int, default=6, help="train steps (the first compiles)")
    p.add_argument("--prompt-cache", choices=("config", "on", "off", "both"), default="config",
                   help="targets.prompt_cache as the config says, on, off, or both one after the other")
    p.add_argument("--workdir", help="folder for the slice's targets and checkpoints (default: a temporary one)")
    p.add_argument("--note", default="", help="a line for the report's header (e.g. the machine's load)")
    p.add_argument("--out", help="also write the Markdown report here (and its numbers beside it as .json)")
    args = p.parse_args(argv)
    cfg = RunConfig.from_yaml(args.config)
    settings = {"config": [cfg.targets.prompt_cache], "on": [True], "off": [False], "both": [False, True]}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for on in settings[args.prompt_cache]:
            c = dataclasses.replace(cfg, targets=dataclasses.replace(cfg.targets, prompt_cache=on))
            runs.append(measure(c, pathlib.Path(args.workdir or tmp) / ("cache" if on else "prefill"),
                                chunks=args.chunks, steps=args.steps))
    text = report(runs, args.config, args.note)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        numbers = {"config": args.config, **runs[0]} if len(runs) == 1 else {"config": args.config, "runs": runs}
        out.with_suffix(".json").write_text(json.dumps(numbers, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
