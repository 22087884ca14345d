"""``python -m kvjax.bench capacity``: for a fixed KV memory and context length, how many rows of decode
cache fit, per setting (the full cache and each policy x ratio) and KV storage (`--kv-quant`), and the
decode tokens/s at that batch.

The model is a random-weight Llama in bfloat16 of the size given by the options, so the numbers are
about cost, not quality. Per setting and storage:

- **bytes per row**: `kvjax.generate_settings` on one row of `--context` tokens (one shared prefill for
  every setting), `GenerateOutput.cache_bytes`: the decode cache the engine allocates for the row, all of
  it (keys and values or their codes, scales and zero points, the full-precision window, positions,
  valid bits and write pointers), at the engine's capacity (the prompt's bucket, or the policy's kept
  capacity, + the decode room of `--new-tokens`);
- **batch**: floor(memory / bytes per row), and its ratio to the batch of the full cache in bf16
  (storage none);
- **decode tokens/s at that batch**: the same row's decode cache, built by the engine's own steps
  (prefill, compression, quantization: its bytes checked equal to `cache_bytes`) and repeated to the
  batch, decoded `--new-tokens` tokens by the engine's jitted decode loop (`steps.decode`, greedy, no
  stop token; the cache copied fresh for each run, not timed); median of `--repeats` runs after a
  compile run. On CPU the batch is capped by `--max-measured-batch` (default 16; the table says when),
  on an accelerator it is not unless asked.
- **tokens**: the timed decode's tokens against `kvjax.generate`'s for the row (greedy): "same"; or,
  when the batch's rows (all equal) part from them at some token, the same cache decoded at batch 1
  is checked instead ("same at batch 1", and where the batch parted: a random-weight model in
  bfloat16 has near-ties that sums of another batch size can tip); "NO" (exit status 1) otherwise.

The batch arithmetic assumes the memory holds decode caches only (no model weights, activations or
allocator slack), rows of one length, and no sharing between rows.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import policies as kvpolicies
from kvjax.bench._timing import emit, header_lines, markdown_table
from kvjax.bench.prefill import load_average
from kvjax.engine import Setting, generate_settings, make_plan, steps
from kvjax.engine.inputs import BUCKETS, STEP_BUCKETS, bucket_length
from kvjax.kv_quant import PRESETS
from kvjax.models.config import ModelConfig
from kvjax.models.export import init_params
from kvjax.models.model import Model
from kvjax.sampling import Sampler

HELP = ("the largest batch of decode caches that fits a fixed KV memory, and the decode tokens/s at that batch, "
        "for the full cache and policy x ratio x KV storage")
CPU_MEASURED_BATCH = 16  # --max-measured-batch auto on CPU
COLUMNS = ("policy", "setting", "kv_quant", "MiB per row", "K/V data %", "scales + zeros %", "window %",
           "positions + valid %", "batch", "x bf16 full", "measured batch", "decode tok/s", "ms per step",
           "tokens")


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ratios(text: str) -> list[float]:
    try:
        return [float(x) for x in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--compression-ratios takes numbers, got {text!r}") from None


def _storages(text: str) -> list[str]:
    names = _names(text)
    accepted = ("none", *PRESETS)
    unknown = [n for n in names if n not in accepted]
    if unknown or not names:
        got = ", ".join(map(repr, unknown)) or "(none given)"
        raise argparse.ArgumentTypeError(f"--kv-quant: unknown storage(s) {got}; accepted: {', '.join(accepted)}")
    return list(dict.fromkeys(names))


def _measured(text: str) -> int | None | str:
    if text in ("auto", "none"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max-measured-batch takes 'auto', 'none' or a count >= 0 "
                                         f"(0: no decode timing), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-gib", type=float, default=1.0, help="KV memory for the decode caches, GiB")
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens per row (e.g. 8192, 32768)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode room per row and tokens timed per run")
    parser.add_argument("--policies", type=_names, default=["snapkv"],
                        help="comma-separated presets that compress at prefill ('none': the full cache only)")
    parser.add_argument("--compression-ratios", type=_ratios, default=[0.5], help="comma-separated fractions removed")
    parser.add_argument("--kv-quant", type=_storages, default=["none", "int8", "int4", "int2"],
                        help="comma-separated storages: none or presets of kvjax.kv_quant.PRESETS "
                             f"({', '.join(PRESETS)})")
    parser.add_argument("--max-measured-batch", type=_measured, default="auto",
                        help=f"cap on the batch the decode is timed at: a count (0: no timing), 'none', or 'auto' "
                             f"({CPU_MEASURED_BATCH} on CPU, no cap on an accelerator)")
    parser.add_argument("--hidden", type=int, default=512, help="model width")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="query heads (head_dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="timed decode runs per cell (median reported)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--note", default="", help="a line added to the report's header")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown report here")


def bench_model(args: argparse.Namespace) -> Model:
    """A random-weight Llama in bfloat16 of the options' size, positions for the context and its decode room."""
    cfg = ModelConfig(family="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                      max_position_embeddings=bucket_length(args.context, BUCKETS) + args.new_tokens,
                      rope_theta=500000.0, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), init_params(cfg, jax.random.PRNGKey(0)))
    return Model(config=cfg, params=params)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the option for values the bench cannot run."""
    if args.memory_gib <= 0:
        raise ValueError(f"--memory-gib must be positive, got {args.memory_gib}")
    for name in ("context", "new_tokens", "repeats", "hidden", "layers", "heads", "kv_heads", "vocab"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be at least 2 (one decode step after the first token), "
                         f"got {args.new_tokens}")
    for r in args.compression_ratios:
        if not 0 <= r < 1:
            raise ValueError(f"--compression-ratios: {r} is not in [0, 1)")
    for name in [p for p in args.policies if p != "none"]:
        policy = kvpolicies.get(name)
        if policy.decode_time or steps.rope_mode(policy) != "original":
            raise ValueError(f"--policies: {name!r} evicts while decoding or re-rotates keys (rope_mode "
                             f"{steps.rope_mode(policy)!r}); the capacity bench repeats one row's decode cache to the "
                             "batch, so it takes presets that compress at prefill in rope_mode 'original' (e.g. "
                             "snapkv, pyramidkv, ada_snapkv, knorm, streaming_llm_kvpress)")


def make_settings(args: argparse.Namespace) -> list[Setting]:
    """The full cache at each storage, then each policy x ratio at each storage."""
    storages = [None if q == "none" else q for q in args.kv_quant]
    out = [Setting(None, kv_quant=q) for q in storages]
    out += [Setting(p, compression_ratio=r, kv_quant=q) for p in args.policies if p != "none"
            for r in args.compression_ratios for q in storages]
    return out


def breakdown(cache: Any) -> dict[str, int]:
    """Bytes of a decode cache by kind: "data" (keys and values, or their codes), "scales" (scales and
    zero points), "window" (the full-precision window), "meta" (positions, valid bits, write pointers)."""
    if hasattr(cache, "config"):  # QuantizedKVCache
        codes = int(cache.k.codes.nbytes + cache.v.codes.nbytes)
        scales = sum(int(a.nbytes) for q in (cache.k, cache.v) for a in (q.scale, q.zero) if a is not None)
        window = int(cache.rk.nbytes + cache.rv.nbytes)
        meta = sum(int(a.nbytes) for a in (cache.pos, cache.valid, cache.fill, cache.flushed))
    else:
        codes, scales, window = int(cache.k.nbytes + cache.v.nbytes), 0, 0
        meta = int(cache.pos.nbytes + cache.valid.nbytes)
    local = 0 if cache.local is None else int(cache.local.nbytes())
    return {"data": codes, "scales": scales, "window": window, "meta": meta + local}


def row_cache(model: Model, setting: Setting, prefilled: dict[str, Any], *, bucket: int, room: int) -> tuple:
    """One row's decode cache for `setting` by the engine's steps (as `kvjax.generate` builds it): the
    prefilled cache compressed (or grown, for the full cache) to bucket + room slots, then quantized.
    Returns (first token [1], cache)."""
    cfg = model.config
    policy = None if setting.policy is None else kvpolicies.resolve(setting.policy)
    first, cache, observations = prefilled[steps.rope_mode(policy)]
    if policy is None:
        cache = steps.grow(cache, capacity=bucket + room, mesh=None)
    else:
        plan = make_plan(policy, np.array([prefilled["length"]]), cfg, budget=setting.budget,
                         compression_ratio=setting.compression_ratio, bucket=bucket, room=room, question_tokens=0)
        cache, _ = steps.compress(cache, observations, plan, policy=policy, capacity=bucket + room, mesh=None)
    if setting.kv_quant is not None:
        setting.kv_quant.check(cfg.head_dim)
        cache = steps.to_quantized(cache, config=setting.kv_quant, room=room)
    return first, cache


def repeat_rows(cache: Any, batch: int) -> Any:
    """The one-row cache repeated to `batch` rows (every buffer holds rows on axis 1: [L, B, ...])."""
    return jax.tree.map(lambda a: jnp.repeat(a, batch, axis=1), cache)


def time_decode(model: Model, first: jax.Array, cache: Any, *, batch: int, length: int, new_tokens: int,
                repeats: int) -> tuple[float, np.ndarray]:
    """Median seconds of `new_tokens - 1` decode steps at `batch` rows (after a compile run), and the
    tokens [batch, new_tokens]."""
    cfg = model.config
    big = repeat_rows(cache, batch)
    jax.block_until_ready(big)
    S = bucket_length(new_tokens, STEP_BUCKETS)
    firsts = jnp.repeat(first, batch)
    pos0 = jnp.full((batch,), length, jnp.int32)

    def run() -> tuple[float, Any]:
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, big))  # the decode loop donates its cache
        start = time.perf_counter()
        final = steps.decode(model.params, fresh, None, firsts, pos0, jax.random.PRNGKey(0), None,
                             jnp.int32(new_tokens), cfg=cfg, steps=S, policy=None, sampler=Sampler(), stop_ids=(),
                             pad_id=0, mesh=None, rope_mode="original")
        tokens = jax.block_until_ready(final.tokens)
        return time.perf_counter() - start, tokens

    _, tokens = run()  # compiles
    seconds = statistics.median(run()[0] for _ in range(repeats))
    return seconds, np.asarray(tokens)[:, :new_tokens]


def token_check(model: Model, first: jax.Array, cache: Any, got: np.ndarray, expected: np.ndarray, *, length: int,
                new_tokens: int) -> str:
    """"same" when every row of the timed decode `got` [B, n] equals `expected` [n] (generate's tokens);
    else, when the rows agree with each other and the same cache decoded at batch 1 gives `expected`,
    "same at batch 1 (batch B from token k)"; else "NO"."""
    if (got == expected[None]).all():
        return "same"
    if len(got) > 1 and (got == got[:1]).all():
        _, one = time_decode(model, first, cache, batch=1, length=length, new_tokens=new_tokens, repeats=1)
        if (one[0] == expected).all():
            return f"same at batch 1 (batch {len(got)} from token {int(np.argmax(got[0] != expected))})"
    return "NO"


def measured_cap(option: Any) -> int | None:
    """The batch cap of `--max-measured-batch` on this backend (None: no cap)."""
    if option == "auto":
        return CPU_MEASURED_BATCH if jax.default_backend() == "cpu" else None
    return None if option == "none" else int(option)


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as err:
        raise SystemExit(f"python -m kvjax.bench capacity: error: {err}") from None
    results, report = measure(args)
    emit(report, args.out)
    return 0 if all(r["tokens"] != "NO" for r in results) else 1


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """Runs the bench (options already checked): one record per setting that ran (policy, setting, kv_quant,
    bytes_per_row, parts (bytes by kind, `breakdown`), batch, ratio (to the full cache at storage none),
    bytes_ratio, measured_batch, capped, tokens_per_s, ms_per_step, tokens (the check against generate's
    tokens, as the table shows it)), and the Markdown report."""
    from tqdm.auto import tqdm

    model = bench_model(args)
    cfg = model.config
    memory = int(args.memory_gib * 2**30)
    cap = measured_cap(args.max_measured_batch)
    prompt = [1] + np.random.RandomState(args.context).randint(3, cfg.vocab_size, args.context - 1).tolist()
    settings = make_settings(args)
    print(f"generate: one row of {args.context} tokens, {len(settings)} settings sharing one prefill", flush=True)
    outs = generate_settings(model, [prompt], settings, max_new_tokens=args.new_tokens, stop_tokens=[],
                             on_error="return")
    bucket = bucket_length(args.context, BUCKETS)
    room = bucket_length(args.new_tokens, STEP_BUCKETS)
    tokens, positions = (jnp.asarray(a) for a in (np.array([prompt + [0] * (bucket - len(prompt))], np.int32),
                                                  np.array([list(range(len(prompt))) + [-1] * (bucket - len(prompt))],
                                                           np.int32)))
    prefilled: dict[str, Any] = {"length": len(prompt)}
    resolved = [None if st.policy is None else kvpolicies.resolve(st.policy) for st in settings]
    for mode in dict.fromkeys(steps.rope_mode(p) for p in resolved):
        spec = steps.prefill_spec([p for p in resolved if steps.rope_mode(p) == mode])
        first, cache, obs, _ = steps.prefill(model.params, tokens, positions, jax.random.PRNGKey(0), cfg=cfg,
                                             capacity=bucket, observe=spec, rope_mode=mode, sampler=Sampler(),
                                             mesh=None)
        prefilled[mode] = first, cache, obs
    base = next((o.cache_bytes for st, o in zip(settings, outs)
                 if st.policy is None and st.kv_quant is None and not isinstance(o, Exception)), None)
    base_batch = None if base is None else memory // base
    rows, results, refused = [], [], []
    bar = tqdm(list(zip(settings, outs)), desc="capacity", unit="setting", disable=args.no_progress)
    for st, out in bar:
        storage = "none" if st.kv_quant is None else st.kv_quant.name
        label = "full" if st.policy is None else f"r={st.compression_ratio:g}"
        bar.set_postfix_str(f"{st.policy_name} {label} {storage}")
        if isinstance(out, Exception):
            rows.append([st.policy_name, label, storage, "refused", *["-"] * (len(COLUMNS) - 4)])
            refused.append(f"- {st.policy_name} {label} {storage}: refused: {out}")
            print(refused[-1], flush=True)
            continue
        per_row = int(out.cache_bytes)
        first, cache = row_cache(model, st, prefilled, bucket=bucket, room=room)
        parts = breakdown(cache)
        if sum(parts.values()) != int(cache.nbytes()) or int(cache.nbytes()) != per_row:
            raise RuntimeError(f"{st.policy_name} {label} {storage}: the bench's decode cache holds {cache.nbytes()} "
                               f"bytes ({parts}), kvjax.generate's {per_row}: not the same cache")
        batch = memory // per_row
        measured = batch if cap is None else min(batch, cap)
        tok_s = ms = None
        check = "-"
        if measured >= 1:
            seconds, got = time_decode(model, first, cache, batch=measured, length=len(prompt),
                                       new_tokens=args.new_tokens, repeats=args.repeats)
            tok_s = measured * (args.new_tokens - 1) / seconds
            ms = seconds / (args.new_tokens - 1) * 1e3
            check = token_check(model, first, cache, got, out.tokens[0], length=len(prompt),
                                new_tokens=args.new_tokens)
        pct = {k: 100 * v / per_row for k, v in parts.items()}
        result = dict(policy=st.policy_name, setting=label, kv_quant=storage, bytes_per_row=per_row, parts=parts,
                      batch=batch, ratio=None if not base_batch else batch / base_batch,
                      bytes_ratio=None if base is None else base / per_row, measured_batch=measured,
                      capped=measured < batch, tokens_per_s=tok_s, ms_per_step=ms, tokens=check)
        results.append(result)
        rows.append([st.policy_name, label, storage, _fmt(per_row / 2**20, 3), *(_fmt(pct[k], 1) for k in
                     ("data", "scales", "window", "meta")), str(batch), _fmt(result["ratio"]),
                     "-" if measured < 1 else (f"{measured} (capped)" if result["capped"] else str(measured)),
                     _fmt(tok_s, 1), _fmt(ms), check])
        print(f"{st.policy_name:10s} {label:6s} {storage:14s} {per_row / 2**20:9.2f} MiB/row  batch {batch:6d}  "
              f"x{result['ratio'] or 0:.2f}  " + (f"{tok_s:9.1f} tok/s at {measured}" if tok_s else ""), flush=True)
    bar.close()
    report = "\n".join([
        "# KV capacity: the largest batch in a fixed KV memory, and decode tokens/s at that batch", "",
        *header_lines(), f"- load average (1, 5, 15 min): {load_average()}",
        *([f"- {args.note}"] if args.note else []),
        (f"- model: random-weight Llama, {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} query / "
         f"{cfg.num_kv_heads} KV heads (head_dim {cfg.head_dim}), bfloat16"),
        (f"- KV memory {args.memory_gib:g} GiB ({memory} bytes); one row = a prompt of {args.context} tokens (bucket "
         f"{bucket}) + {args.new_tokens} new tokens (decode room {room})"),
        ("- MiB per row: `GenerateOutput.cache_bytes` of one row, all of its decode cache; the % columns split it: "
         "K/V data (keys and values, or their codes), scales + zeros (per-group float16 scales and int8 zero "
         "points), window (the full-precision window of recent entries), positions + valid (and write pointers)"),
        "- batch = floor(memory / bytes per row); x bf16 full = batch / the full cache's batch at storage none",
        (f"- decode tok/s: {args.new_tokens - 1} decode steps at the measured batch (the row's cache repeated), median "
         f"of {args.repeats} runs after a compile run; "
         + ("no cap on the measured batch" if cap is None else f"measured batch capped at {cap} "
            f"(--max-measured-batch {args.max_measured_batch}): a capped cell is timed below its batch")),
        ("- tokens: the timed decode's against kvjax.generate's for the row (greedy): same; or same at batch 1 "
         "(the same cache decoded at batch 1), the batch's rows (all equal) parting from them at token k (bf16 "
         "near-ties of a random-weight model tipped by sums of another batch size); NO otherwise"), "",
        markdown_table(COLUMNS, rows), "", *refused, *([""] if refused else []),
        f"Command: `{command_env()}python -m kvjax.bench capacity {' '.join(command_args(args))}`", ""])
    return results, report


def command_env() -> str:
    """The attention implementation order when the environment sets one (it changes what is timed)."""
    value = os.environ.get("KVJAX_ATTENTION_IMPLEMENTATION")
    return f"KVJAX_ATTENTION_IMPLEMENTATION={value} " if value else ""


def command_args(args: argparse.Namespace) -> list[str]:
    """The options of this run, as given on a command line."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    out = []
    for action in defaults._actions:
        if not action.option_strings or action.dest in ("help", "no_progress", "note"):
            continue
        value = getattr(args, action.dest, None)
        if value == action.default or (isinstance(action.default, str) and action.type is not None
                                        and value == action.type(action.default)):
            continue
        flag = action.option_strings[0]
        text = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) if isinstance(value, list) \
            else (f"{value:g}" if isinstance(value, float) else str(value))
        out += [flag, text]
    return out
