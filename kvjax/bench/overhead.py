"""``python -m kvjax.bench overhead``: prefill time with and without eviction scoring, per policy.

The model is a random-weight Llama-family model of the size given by the options (what the
machine can run), so the numbers are about cost, not quality. "full" is the jitted prefill with
no policy; "+eviction" is the same prefill that also records the policy's observations, scores,
selects and compacts the cache. Both run on one prompt filling the bucket. For KVzip the
"+eviction" prefill includes its repeat-the-context passes (its reconstruction observation); for
LookaheadKV, the pass of its lookahead tokens (an adapter of default size, fresh for the bench model).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import lookahead, policies
from kvjax.bench._timing import emit, header_lines, markdown_table, median_seconds
from kvjax.engine import make_plan, steps
from kvjax.models.config import ModelConfig
from kvjax.models.export import init_params
from kvjax.models.model import Model
from kvjax.sampling import Sampler

HELP = "prefill time with and without eviction scoring per policy, and their ratio"


def bench_config(args: argparse.Namespace) -> ModelConfig:
    """The benches' random-weight Llama from args.vocab, hidden, layers, heads, kv_heads, lengths, dtype and, where
    the bench has the option, intermediate (the MLP width; absent or None: 4 x hidden)."""
    intermediate = getattr(args, "intermediate", None) or 4 * args.hidden
    return ModelConfig(family="llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=intermediate,
                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.hidden // args.heads, max_position_embeddings=max(args.lengths) + 1,
                       rope_theta=500000.0, dtype=args.dtype)


def alternating_times(fns, repeats: int) -> list[list[float]]:
    """Seconds of each run of each of `fns` (no arguments), run in turn (after a compile run each) so
    that load on the machine falls on all alike: one list per function, run i of each in the same round.
    Round i starts at function i mod len(fns), so that no function always runs first (after the previous
    round's last, whose freed outputs a fresh allocation may pay for) or always last."""
    for fn in fns:
        jax.block_until_ready(fn())
    times = [[] for _ in fns]
    for i in range(repeats):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            start = time.perf_counter()
            jax.block_until_ready(fns[k]())
            times[k].append(time.perf_counter() - start)
    return times


def paired_times(a, b, repeats: int) -> tuple[list[float], list[float]]:
    """`alternating_times` of two functions."""
    ta, tb = alternating_times([a, b], repeats)
    return ta, tb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(policies.available()),
                        help="comma-separated presets (default: all of kvjax.policies.available())")
    parser.add_argument("--lengths", default="4096,16384", type=lambda s: [int(x) for x in s.split(",")],
                        help="prompt lengths (each is its own bucket)")
    parser.add_argument("--compression-ratio", type=float, default=0.5, help="fraction of the prompt removed")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default: 4 x --hidden; SmolLM2-135M: 1536)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median reported)")
    parser.add_argument("--lookahead-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a LookaheadConfig field of the bench's fresh adapter (n_tokens=8, window=32, ...; "
                             "repeatable)")
    parser.add_argument("--lookahead-members", type=int, default=1,
                        help="the adapter as an ensemble of this many members (kvjax.lookahead.stack)")
    parser.add_argument("--separate-passes", action="store_true",
                        help="run every producer pass after the prefill (lookahead_kv's tokens otherwise ride the "
                             "prefill, as in the engine)")
    parser.add_argument("--compare-riding", action="store_true",
                        help="for a policy whose pass rides the prefill, also time in the same rounds the prefill "
                             "without the riding rows and their pass after it (two more columns)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown report here")


def lookahead_config(items: list[str]) -> lookahead.LookaheadConfig:
    """The bench adapter's config from NAME=VALUE items (ints, floats, "none" as written)."""
    fields = {f.name: f for f in dataclasses.fields(lookahead.LookaheadConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--lookahead-option {item!r}: expected NAME=VALUE with NAME one of {sorted(fields)}")
        default = fields[name].default
        out[name] = None if value == "none" else type(default)(value) if isinstance(default, (int, float)) and \
            not isinstance(default, bool) else value
    try:
        return lookahead.LookaheadConfig(**out)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"--lookahead-option: {err}") from None


def run(args: argparse.Namespace) -> int:

    cfg = bench_config(args)
    params = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), init_params(cfg, jax.random.PRNGKey(0)))
    la_config = lookahead_config(args.lookahead_option)
    if args.lookahead_members < 1:
        raise SystemExit(f"--lookahead-members must be >= 1, got {args.lookahead_members}")
    names = [n for n in args.policies.split(",") if n]
    unknown = sorted(set(names) - set(policies.available()))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; available: {', '.join(policies.available())}")
    rows = []
    ran_lookahead = False
    for T in args.lengths:
        tokens = jnp.asarray(np.random.RandomState(T).randint(3, cfg.vocab_size, (1, T)), jnp.int32)
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        key = jax.random.PRNGKey(0)
        common = dict(cfg=cfg, sampler=Sampler(), mesh=None)

        def full(params=params):
            return steps.prefill(params, tokens, positions, key, capacity=T, observe=steps.prefill_spec([None]),
                                 rope_mode="original", **common)

        for name in names:
            policy = policies.get(name)
            adapter = None
            if policy.requirements().observe.lookahead:  # its own modules, sized for the bench model
                model = Model(config=cfg, params=params)
                members = [lookahead.init_adapter(model, la_config, jax.random.PRNGKey(m))
                           for m in range(args.lookahead_members)]
                policy = dataclasses.replace(policy, adapter=lookahead.stack(members))
                ran_lookahead = True
            try:
                plan = make_plan(policy, np.array([T]), cfg, budget=None, compression_ratio=args.compression_ratio,
                                 bucket=T, room=0, question_tokens=0)
            except ValueError as e:
                rows.append([name, T, "n/a", "n/a", "n/a", "n/a", f"not run: {e}", "n/a", "n/a", "n/a", "n/a"]
                            + ["n/a", "n/a"] * args.compare_riding)
                continue

            riding = None if args.separate_passes else steps.riding_pass([policy], steps.rope_mode(policy))

            def observed(params=params, policy=policy, riding=riding):
                return steps.prefill(params, tokens, positions, key, capacity=T, observe=steps.prefill_spec([policy]),
                                     rope_mode=steps.rope_mode(policy), riding=riding and riding[0],
                                     riding_inputs=riding and riding[1], **common)[1:3]

            def after(cache, obs, params=params, plan=plan, policy=policy, riding=riding):
                for o in policy.requirements().observe.producers:  # passes after the prefill (kvzip, lookahead_kv)
                    if riding is None or o != riding[0]:
                        obs = obs.replace(**steps.produce(params, cache, tokens, positions, policy.observation_inputs(),
                                                          cfg=cfg, observation=o, rope_mode=steps.rope_mode(policy)))
                return steps.compress(cache, obs, plan, policy=policy, capacity=T, mesh=None)

            records = steps.prefill_spec([policy]) != steps.prefill_spec([None]) or riding is not None or \
                steps.rope_mode(policy) != "original"  # otherwise the policy's prefill is the full one
            timed = [full, lambda: after(*observed())] + ([observed] if records else [])
            compare = args.compare_riding and riding is not None
            if compare:  # the prefill without the riding rows, and their pass after it, in the same rounds
                def apart(params=params, policy=policy):
                    return steps.prefill(params, tokens, positions, key, capacity=T,
                                         observe=steps.prefill_spec([policy]), rope_mode="original", **common)[1:3]

                def pass_after(params=params, cache=apart()[0], riding=riding):
                    return steps.produce(params, cache, tokens, positions, riding[1], cfg=cfg, observation=riding[0],
                                         rope_mode="original")

                timed += [apart, pass_after]
            runs_full, runs_evict, *runs_observed = alternating_times(timed, args.repeats)
            base, t = statistics.median(runs_full), statistics.median(runs_evict)
            prefilled = observed()
            alone = median_seconds(after, prefilled, args.repeats)
            del prefilled
            paired = statistics.median(e / f for e, f in zip(runs_evict, runs_full))
            inside = statistics.median(o - f for o, f in zip(runs_observed[0], runs_full)) if records else 0.0
            rows.append([name, T, base * 1e3, t * 1e3, t / base, paired,
                         f"{(t - base) * 1e3:.1f} ms", alone * 1e3, 1 + alone / base, inside * 1e3,
                         1 + (inside + alone) / base])
            if args.compare_riding:
                rows[-1] += [statistics.median(r - a for r, a in zip(runs_observed[0], runs_observed[1])) * 1e3,
                             statistics.median(runs_observed[2]) * 1e3] if compare else ["n/a", "n/a"]
            print(f"{name:28s} T={T:6d}  full {base * 1e3:9.1f} ms  +eviction {t * 1e3:9.1f} ms  ratio {t / base:.3f}"
                  f"  after the prefill alone {alone * 1e3:7.1f} ms  recorded inside {inside * 1e3:7.1f} ms",
                  flush=True)
    table = markdown_table(["policy", "prompt tokens", "prefill ms (full)", "prefill ms (+eviction)", "ratio",
                            "median of paired ratios", "overhead", "after the prefill, alone (ms)",
                            "1 + alone / full", "recorded inside the prefill (ms)",
                            "1 + (recorded inside + alone) / full"]
                           + ["riding rows inside the prefill (ms)", "their pass after the prefill (ms)"]
                           * args.compare_riding, rows)
    report = "\n".join([
        "# Eviction overhead at prefill", "", *header_lines(),
        f"- model: random-weight Llama, {cfg.num_layers} layers, width {cfg.hidden_size} (MLP "
        f"{cfg.intermediate_size}), vocabulary {cfg.vocab_size}, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads (head_dim {cfg.head_dim}), {cfg.dtype}; batch 1",
        f"- compression_ratio {args.compression_ratio}; median of {args.repeats} runs after a compile run, "
        "the two prefills run alternately",
        "- median of paired ratios: each +eviction run over the full run just before it, the median of those "
        "(a drift of the machine's speed over the run falls on both of a pair)",
        "- after the prefill, alone: the policy's passes after the prefill, scoring, selection and compaction timed "
        "on their own (median), on a prefilled cache: the overhead without the difference of two long, noisy "
        "prefills (what a policy records inside the prefill, e.g. output norms, is not in it)",
        "- recorded inside the prefill: the median of paired differences between the prefill recording the "
        "policy's observations (window attention, output norms, ...) and the full one, run in the same rounds; 0 "
        "where the policy's prefill is the full one. 1 + (recorded inside + alone) / full: the whole overhead "
        "from these two smaller measures (the recording's difference still spans two long prefills: run at few "
        "layers (--layers) and many repeats to make it tight)",
        "- full = jitted prefill without a policy; +eviction = the same prefill plus observations, scoring, "
        "selection and compaction (kvzip*: its repeat-the-context passes included; lookahead_kv: its lookahead pass)",
        *(["- riding rows inside the prefill: the median of paired differences between the recording prefill with "
            "the riding rows and without them; their pass after the prefill: its median, on the prefilled cache "
            "(both timed in the same rounds as the rest)"] if args.compare_riding else []),
        *([f"- LookaheadKV adapter: {la_config.n_tokens} tokens"
           + (f" x {args.lookahead_members} members" if args.lookahead_members > 1 else "")
           + (f", options {' '.join(args.lookahead_option)}" if args.lookahead_option else "")
           + ("; its tokens run in a pass after the prefill (--separate-passes)" if args.separate_passes else
              "; its members' tokens run in passes after the prefill" if args.lookahead_members > 1 else
              "; its tokens ride the prefill (in each layer after the prompt's rows), as in the engine: their cost "
              "is in 'recorded inside the prefill'")]
          if ran_lookahead else []),
        "", table, ""])
    emit(report, args.out)
    return 0
