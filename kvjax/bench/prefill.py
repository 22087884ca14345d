"""``python -m kvjax.bench prefill``: kvjax's prefill beside transformers' ``sdpa`` forward, same weights.

One random-weight Llama (the options' size) is built in kvjax, written as a Hugging Face checkpoint
(`kvjax.models.export.save_hf`) and read back by transformers, so both run the same weights. Per
prompt length, one prompt filling it is timed, the programs alternating within each repeat so that
load on the machine falls on all alike (median of N runs after a warm-up run each):

- transformers: ``model(ids, logits_to_keep=1)`` under ``torch.no_grad()``, ``attn_implementation="sdpa"``,
  float32, ``torch.set_num_threads`` = the CPU count (XLA's CPU client uses every core too);
- kvjax prefill: the engine's jitted prefill (`kvjax.engine.steps.prefill`: cache written, first token sampled)
  with no observation;
- + snapkv: the same prefill recording SnapKV's window queries, then its scoring, selection and compaction
  (`steps.compress`);
- + column mass: the prefill recording the column mass (H2O's prefill score, `h2o_prefill`), then its
  scoring, selection and compaction.

The ratios compare kvjax's prefill with transformers, and each observed prefill with kvjax's own plain one.

``--attention`` adds a table of one layer's attention alone (the model's heads, batch 1) in each
formulation considered for the prefill: torch's sdpa (causal), kvjax's blocked flash attention (the one
used), the materialised path it replaced (`attend_blocked` in 1024-query blocks), and
``jax.nn.dot_product_attention`` in XLA (the full T x T square; lengths up to 8192).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies
from kvjax.bench._timing import emit, header_lines, markdown_table
from kvjax.bench.overhead import bench_config
from kvjax.engine import make_plan, steps
from kvjax.kernels.attention import Keys, attention
from kvjax.models.export import init_params, save_hf
from kvjax.sampling import Sampler

HELP = "kvjax's prefill (plain, + SnapKV, + column mass) beside transformers' sdpa forward on the same weights"
PROGRAMS = ("transformers sdpa", "kvjax prefill", "+ snapkv", "+ column mass")
COLUMNS = ("prompt tokens", *(f"{p} ms" for p in PROGRAMS), "kvjax / transformers", "snapkv / kvjax",
           "column mass / kvjax")


def cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def alternating_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each fn over `repeats` rounds (each fn once per round, in turn), after one
    warm-up (compile) call each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def hf_model(params, cfg, folder: pathlib.Path):
    """transformers' model of the same weights (sdpa attention, float32, eval mode)."""
    import transformers  # optional ([test] extra): imported when this subcommand runs

    save_hf(folder, params, cfg)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32",
                                                              attn_implementation="sdpa").eval()


ATTENTION = ("torch sdpa", "kvjax flash", "attend_blocked (before)", "jax.nn.dot_product_attention (xla)")
DPA_MAX = 8192  # the XLA dot_product_attention materialises [Hq, T, T] float32


def attention_rows(cfg, lengths: list[int], repeats: int) -> list[list[object]]:
    """One layer's causal attention alone, per formulation (ms, median of `repeats`)."""
    import torch

    B, Hq, Hkv, D = 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    scale = D ** -0.5
    rows = []
    for T in lengths:
        rng = np.random.RandomState(T)
        q, k, v = (rng.randn(B, h, T, D).astype(np.float32) for h in (Hq, Hkv, Hkv))
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        q, k, v = (jnp.asarray(x) for x in (q, k, v))
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        kpos = jnp.broadcast_to(pos[:, None], (B, Hkv, T))

        def sdpa():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale,
                                                                        enable_gqa=True)

        def op(*implementations):  # one implementation of the attention op (the first that accepts the shapes)
            return jax.jit(lambda q, k, v: attention(q, Keys(k, v, kpos), pos, scale=scale, own_keys=True,
                                                     implementation=implementations).out)

        flash, blocked = op("flash"), op("blocked", "materialized")
        dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale, is_causal=True,
            implementation="xla"))
        fns = [sdpa] + [lambda f=f: jax.block_until_ready(f(q, k, v)) for f in (flash, blocked)]
        if T <= DPA_MAX:
            fns.append(lambda: jax.block_until_ready(dpa(q, k, v)))
        times = alternating_medians(fns, repeats)
        cells = [f"{t * 1e3:.1f}" for t in times] + ["n/a"] * (len(ATTENTION) - len(times))
        rows.append([T, *cells, f"{times[1] / times[0]:.2f}x"])
        print(" | ".join(str(x) for x in rows[-1]), flush=True)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384], help="prompt lengths")
    parser.add_argument("--hidden", type=int, default=512, help="model width")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--compression-ratio", type=float, default=0.5, help="for the two policies' compaction")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per program (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU count)")
    parser.add_argument("--attention", action="store_true",
                        help="add a table of one layer's attention alone per formulation (torch sdpa, kvjax flash, "
                             "the materialised path, jax.nn.dot_product_attention)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown report here")


def run(args: argparse.Namespace) -> int:
    import torch  # optional ([test] extra, CPU build): imported when this subcommand runs
    import transformers

    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    args.dtype = "float32"
    cfg = bench_config(args)
    params = init_params(cfg, jax.random.PRNGKey(0))
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    load_start = load_average()
    with tempfile.TemporaryDirectory() as folder:
        hf = hf_model(params, cfg, pathlib.Path(folder))
    snapkv, h2o = policies.get("snapkv"), policies.get("h2o_prefill")
    common = dict(cfg=cfg, sampler=Sampler(), mesh=None)
    rows, parity = [], []
    for T in args.lengths:
        ids = np.random.RandomState(T).randint(3, cfg.vocab_size, (1, T))
        tokens, positions = jnp.asarray(ids, jnp.int32), jnp.arange(T, dtype=jnp.int32)[None]
        key = jax.random.PRNGKey(0)
        torch_ids = torch.tensor(ids)

        def transformers_forward():
            with torch.no_grad():
                return hf(torch_ids, logits_to_keep=1).logits

        def prefill(policy=None):
            spec = steps.prefill_spec([policy])
            out = steps.prefill(params, tokens, positions, key, capacity=T, observe=spec, rope_mode="original",
                                **common)
            if policy is not None:
                plan = make_plan(policy, np.array([T]), cfg, budget=None, compression_ratio=args.compression_ratio,
                                 bucket=T, room=0, question_tokens=0)
                out = steps.compress(out[1], out[2], plan, policy=policy, capacity=T, mesh=None)
            return jax.block_until_ready(out)

        fns = [transformers_forward, prefill, lambda: prefill(snapkv), lambda: prefill(h2o)]
        ref = transformers_forward()[0, -1].numpy()
        parity.append(float(np.abs(np.asarray(prefill()[3][0]) - ref).max() / np.abs(ref).max()))
        t_hf, t_plain, t_snap, t_mass = alternating_medians(fns, args.repeats)
        rows.append([T, t_hf * 1e3, t_plain * 1e3, t_snap * 1e3, t_mass * 1e3, f"{t_plain / t_hf:.2f}x",
                     f"{t_snap / t_plain:.3f}x", f"{t_mass / t_plain:.3f}x"])
        print(" | ".join(str(x) for x in rows[-1]), flush=True)
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    report = "\n".join([
        "# Prefill: kvjax beside transformers (sdpa)", "", *header_lines(),
        f"- machine: {cpu_name()}, {os.cpu_count()} CPU(s); torch threads {threads}; {versions}",
        f"- load average (1, 5, 15 min) at start: {load_start}; at end: {load_average()}",
        f"- model: random-weight Llama, {cfg.num_layers} layers, width {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
        f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads (head_dim {cfg.head_dim}), vocab {cfg.vocab_size}, "
        f"float32, the same weights in both; batch 1",
        f"- median of {args.repeats} runs after a warm-up run each, the four programs alternating; "
        f"last-token logits agree to {max(parity):.1e} (max abs difference / max abs logit)",
        "- transformers sdpa = `model(ids, logits_to_keep=1)` under `torch.no_grad()`; kvjax prefill = the "
        "engine's jitted prefill (cache written, first token sampled); + snapkv / + column mass = the prefill "
        f"recording `snapkv`'s window queries / `h2o_prefill`'s column mass, then scoring, selection and "
        f"compaction at compression_ratio {args.compression_ratio}",
        "", markdown_table(COLUMNS, rows), ""])
    if args.attention:
        table = markdown_table(["prompt tokens", *(f"{a} ms" for a in ATTENTION), "flash / sdpa"],
                               attention_rows(cfg, args.lengths, args.repeats))
        report += "\n".join([
            "", "## One layer's attention alone", "",
            f"Batch 1, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, float32, causal; "
            f"the same median of {args.repeats} alternating runs. jax.nn.dot_product_attention (XLA) materialises "
            f"the whole [Hq, T, T] square and is not run beyond {DPA_MAX} tokens.", "", table, ""])
    emit(report, args.out)
    return 0
