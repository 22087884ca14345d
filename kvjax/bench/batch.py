"""``python -m kvjax.bench batch``: a batch of prompts of mixed lengths in one `kvjax.generate` call,
against the same prompts one by one.

The model is a random-weight Llama-family model of the size given by the options, so the numbers
are about cost, not quality. Three ways to serve the same prompts, timed side by side (each run in
turn, after a compile run each, so that load on the machine falls on all alike):

- "batch (split)": one call, `split="bucket"` (the default): sub-batches per length bucket;
- "one by one": one call per prompt;
- "batch (one padded)": one call, `split=None`: every row padded to the longest prompt's bucket.

Every generated token is checked to be the same in the three (greedy decoding).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from kvjax.bench._timing import emit, header_lines, markdown_table
from kvjax.engine import generate
from kvjax.models.config import ModelConfig
from kvjax.models.export import init_params
from kvjax.models.model import Model

HELP = "a batch of mixed prompt lengths in one generate call vs the same prompts one by one, and their ratio"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="1000,2000,3000,4096", type=_ints,
                        help="prompt lengths of the batch (comma-separated)")
    parser.add_argument("--policy", default="snapkv", help="eviction preset ('none' for the full cache)")
    parser.add_argument("--compression-ratio", type=float, default=0.5, help="fraction of each prompt removed")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--hidden", type=int, default=512, help="model width")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way (median reported)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown report here")


def bench_model(args: argparse.Namespace) -> Model:
    """A random-weight Llama of the options' size, positions for the longest prompt and its answer."""
    cfg = ModelConfig(family="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                      max_position_embeddings=max(args.lengths) + args.new_tokens, rope_theta=500000.0,
                      dtype=args.dtype)
    params = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), init_params(cfg, jax.random.PRNGKey(0)))
    return Model(config=cfg, params=params)


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each of `fns` (by name), run in turn `repeats` times (after the caller's
    compile run), each time printed as it comes."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
            print(f"run {r + 1}/{repeats}: {name:20s} {times[name][-1]:8.2f} s", flush=True)
    return {name: statistics.median(t) for name, t in times.items()}


def ways(model: Model, prompts: list[list[int]], **kw: Any) -> dict[str, Callable[[], np.ndarray]]:
    """The three ways to serve `prompts`; each returns the generated tokens [B, new_tokens]."""
    return {
        "batch (split)": lambda: generate(model, prompts, **kw).tokens,
        "one by one": lambda: np.concatenate([generate(model, [p], **kw).tokens for p in prompts]),
        "batch (one padded)": lambda: generate(model, prompts, split=None, **kw).tokens,
    }


def run(args: argparse.Namespace) -> int:
    model = bench_model(args)
    rng = np.random.RandomState(0)
    prompts = [[1] + rng.randint(3, args.vocab, n - 1).tolist() for n in args.lengths]
    policy = None if args.policy == "none" else args.policy
    kw = dict(policy=policy, compression_ratio=None if policy is None else args.compression_ratio,
              max_new_tokens=args.new_tokens, stop_tokens=[])
    fns = ways(model, prompts, **kw)
    outputs = [fn() for fn in fns.values()]  # the compile run of each way
    same = all(np.array_equal(outputs[0], o) for o in outputs[1:])
    seconds = interleaved_medians(fns, args.repeats)
    base = seconds["one by one"]
    rows = [[name, t, t / base] for name, t in seconds.items()]
    for name, t, r in rows:
        print(f"{name:20s} {t:8.2f} s  ratio to one by one {r:.3f}", flush=True)
    cfg = model.config
    setting = "the full cache" if policy is None else f"{policy} at compression_ratio {args.compression_ratio}"
    report = "\n".join([
        "# A batch of mixed lengths vs the same prompts one by one", "", *header_lines(),
        (f"- model: random-weight Llama, {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} query / "
         f"{cfg.num_kv_heads} KV heads (head_dim {cfg.head_dim}), {cfg.dtype}"),
        (f"- prompts of {', '.join(str(n) for n in args.lengths)} tokens; {setting}; {args.new_tokens} new tokens "
         "each (greedy, no stop token)"),
        f"- median of {args.repeats} runs after a compile run, the three ways run in turn",
        f"- the same generated tokens in all three ways: {'yes' if same else 'NO'}", "",
        markdown_table(["way", "seconds", "ratio to one by one"], rows), ""])
    emit(report, args.out)
    return 0 if same else 1
