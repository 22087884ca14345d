"""``python -m kvjax.eval``: argument parsing, configuration, task generation, run, report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import sys
import textwrap
import warnings
from typing import Any

from kvjax.eval.report import SCORE_NOTE, write_reports
from kvjax.kv_quant import PRESETS as _KV_QUANT
from kvjax.policies.base import check_budget
from kvjax.policies.registry import canonical_name, close_match, lookahead_presets

# `--policies default` (what the default run uses): every preset that scores a prompt from one
# prefill's observations or evicts while decoding, and LookaheadKV with the bundled adapter. The
# 2025-26 scorers (kvzip, expected_attention, critical*, defensivekv, cake_cascade) are in
# `--policies all`; they are meant for real models and would take the default run past its budget.
DEFAULT_POLICIES = [
    "ada_pyramidkv", "ada_snapkv", "adakv_snapkv_kvpress", "cake", "h2o", "h2o_prefill", "knorm", "knorm_kvpress",
    "lazy_eviction", "lookahead_kv", "observed_attention_kvpress", "pyramidkv", "pyramidkv_kvpress", "random",
    "snapkv", "snapkv_kvpress", "streaming_llm", "streaming_llm_kvpress", "tova", "tova_kvpress",
]
DEFAULTS: dict[str, Any] = {
    "model": "bundled",
    "tasks": ["default"],
    "policies": ["default"],
    "compression_ratios": [0.25, 0.5, 0.75, 0.875],
    "budgets": [],
    "context_length": 1024,
    "num_samples": 8,
    "seed": 42,
    "out": None,
    "query_aware": False,
    "batch_size": 8,
    "max_new_tokens": None,
    "data": {},
    "words": "builtin",
    "niah_lengths": None,
    "niah_depths": None,
    "niah_haystack": "essay",
    "fidelity_tokens": 32,
    "lookahead": None,
    "lookahead_options": {},
    "prefill_chunk": None,
    "cache_layout": "dense",
    "kv_quant": ["none"],
}
# Settings that change what a sample or its answer is: a rerun into the same folder must keep them.
RUN_IDENTITY = ("model", "context_length", "seed", "query_aware", "max_new_tokens", "data", "words",
                "niah_lengths", "niah_depths", "niah_haystack", "fidelity_tokens", "lookahead", "lookahead_options",
                "prefill_chunk", "cache_layout")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
LOOKAHEAD_PRESETS = frozenset(lookahead_presets())  # they run a LookaheadKV adapter (--lookahead)
LOOKAHEAD_OPTIONS = ("kernel", "pool_offset", "bridge", "tail", "tail_weight", "pooling", "gqa_reduce", "protect_last",
                     "window", "window_weight")  # read at inference, not trained
KV_QUANT_PRESETS = tuple(_KV_QUANT)  # the names --kv-quant accepts, beside "none"

EPILOG = """\
tasks and suites:
  suites: default (RULER needle tasks + vt: what the bundled model is scored on), ruler (13),
  synthetic (everything generated from code), longbench (16, local files), math (local files).
  --list prints every task and policy. RULER tasks are generated offline, fitted to the model's
  tokenizer and --context-length; tasks needing outside data read --data files or are skipped
  with the reason.
data files (--data NAME=PATH, repeatable):
  essay (text, or RULER's PaulGrahamEssays.json; default: built-in prose), squad (SQuAD v2 dev
  JSON, qa_1), hotpotqa (HotpotQA dev-distractor JSON, qa_2), longbench (folder of {task}.jsonl),
  gsm8k / math500 / aime24 / aime25 (JSONL), fidelity (text), fidelity_ids (.npy/.json ids).
outputs (in --out):
  results.jsonl (one line per task, policy, ratio/budget, KV storage, sample; kv_quant: the
  storage; its stats hold the cache the answer used: kept_mean, kept_peak, kv_bytes_mean,
  kv_bytes_peak, kv_bytes16_mean, kv_bytes16_peak, budget, budget_reached), results.md,
  results.csv, metrics.json, score_vs_compression.png, score_vs_kv_bytes.png (score against the
  KV bytes at 16 bits per element: equal-memory comparisons across storages), niah_heatmaps/,
  run_config.json. A rerun with the same
  --out resumes: finished entries are not recomputed; the model, context length, seed and the
  other sample-defining options must match the folder's run_config.json.
config files:
  --config PATH or NAME (configs/eval_NAME.yaml): YAML with the option names as keys
  (underscores); options given on the command line win. configs/eval_default.yaml holds the
  defaults used when no config is given.
policies:
  preset names in any spelling kvjax.policies accepts (snapkv, SnapKV, snap_kv; SnapKVPress means
  the kvpress preset snapkv_kvpress); results are recorded under the preset's name.
interrupting:
  Ctrl-C stops a run (exit status 130) and prints the command that resumes it.
"""
EPILOG += "scores (the table, results.md):\n" + "\n".join(
    textwrap.fill(line, 98, initial_indent="  ", subsequent_indent="  ") for line in SCORE_NOTE) + "\n"


def _csv(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _floats(values: list[str] | None, name: str, parser: argparse.ArgumentParser) -> list[float] | None:
    try:
        return None if values is None else [float(v) for v in _csv(values)]
    except ValueError:
        parser.error(f"{name} takes numbers, got {values}")


def _ints(values: list[str] | None, name: str, parser: argparse.ArgumentParser) -> list[int] | None:
    try:
        return None if values is None else [int(v) for v in _csv(values)]
    except ValueError:
        parser.error(f"{name} takes integers, got {values}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvjax.eval", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Evaluate KV-cache eviction policies at several compression ratios (or budgets), plus the "
                    "full cache, on long-context tasks; write per-sample results, a summary table and a plot.")
    a = p.add_argument
    a("--config", help="YAML config file, or a name in configs/ (eval_NAME.yaml)")
    a("--model", help="'bundled' (the small model shipped in kvjax), a local folder, a .gguf file, or a Hub id "
                     "(default: bundled)")
    a("--tasks", nargs="+", metavar="TASK", help="task or suite names, space or comma separated (default: default)")
    a("--policies", nargs="+", metavar="POLICY",
      help="preset names in any spelling (snapkv, SnapKV, SnapKVPress); 'default' (the 20 presets of the "
           "recorded default run, kvjax.eval.cli.DEFAULT_POLICIES), 'all' (every registered preset) or 'none' "
           "(the full cache only) (default: default)")
    a("--compression-ratios", nargs="+", metavar="R",
      help="fractions of the prompt's KV entries removed, in [0, 1) (default: 0.25 0.5 0.75 0.875)")
    a("--budgets", nargs="+", metavar="C", help="absolute budgets, entries kept per KV head (replaces the default "
                                                "ratios unless --compression-ratios is also given)")
    a("--context-length", type=int, help="prompt + answer tokens each generated sample is fitted to (default: 1024)")
    a("--num-samples", type=int, help="samples per task (default: 8; the needle grid has one per cell)")
    a("--seed", type=int, help="seed of the generated tasks (default: 42)")
    a("--out", help="output folder (default: out/eval/<model>_L<context>_<query mode>_seed<seed>)")
    a("--query-aware", action=argparse.BooleanOptionalAction, default=None,
      help="compress the context together with the question (default: no, the question comes after "
           "compression, as in kvpress)")
    a("--batch-size", type=int, help="samples per generate call (default: 8)")
    a("--max-new-tokens", type=int, help="cap on each task's answer length (default: the task's own cap)")
    a("--data", action="append", metavar="NAME=PATH", help="a local data file or folder (repeatable; see below)")
    a("--words", choices=["builtin", "wonderwords"],
      help="word lists for RULER keys and common words (default: builtin)")
    a("--niah-lengths", nargs="+", metavar="N",
      help="needle-grid context lengths (default: 1/4..4/4 of --context-length)")
    a("--niah-depths", nargs="+", metavar="D", help="needle-grid depths in percent (default: 0 25 50 75 100)")
    a("--niah-haystack", choices=["essay", "noise"], help="needle-grid haystack (default: essay = --data essay or "
                                                           "built-in prose)")
    a("--fidelity-tokens", type=int, help="continuation tokens scored by the fidelity task (default: 32)")
    a("--lookahead", metavar="PATH", help="LookaheadKV adapter folder for lookahead_kv and its compositions "
                                          "(ada_, layer_, cake_, critical_, critical_ada_lookahead_kv; default: "
                                          "the bundled model's, kvjax/assets/lookahead; without one, 'all' leaves "
                                          "them out)")
    a("--lookahead-option", action="append", metavar="NAME=VALUE",
      help="override an inference-time field of the adapter's config, repeatable: "
           f"{', '.join(LOOKAHEAD_OPTIONS)} (e.g. kernel=15: max pooling over 15 positions; pooling=none)")
    a("--prefill-chunk", type=int, metavar="N",
      help="prefill each context N tokens at a time, evicting down to the budget after every chunk (README, "
           "'Chunked prefill'); policies without chunked prefill are skipped; the full cache stays one-shot "
           "(default: one-shot prefill)")
    a("--cache-layout", choices=["dense", "ragged"],
      help="decode cache layout: dense [L,B,Hkv,C,D] (default) or ragged, where adaptive budgets (pyramidkv, "
           "ada_*, cake) store only the entries they keep (README, 'Ragged decode layout'; quantized too with "
           "--kv-quant); answers are the same, the recorded cache bytes are not")
    a("--kv-quant", nargs="+", metavar="STORAGE",
      help="KV storages, space or comma separated: 'none' (the model dtype) or presets of kvjax.kv_quant.PRESETS "
           f"({', '.join(KV_QUANT_PRESETS)}); every setting, the full cache included, runs at each; the kept "
           "cache is quantized after compression (default: none)")
    a("--compilation-cache", metavar="DIR|off",
      help="folder of jax's persistent compilation cache, so that a later run skips compiling the same "
           "programs, or 'off' (default: $KVJAX_COMPILATION_CACHE if set, else $XDG_CACHE_HOME/kvjax/jax or "
           "~/.cache/kvjax/jax)")
    a("--list", action="store_true", help="list tasks, suites and policies, then exit")
    a("--no-progress", action="store_true", help="no progress bars")
    return p


def find_config(name: str) -> pathlib.Path:
    """A config path as given, else configs/eval_NAME.yaml or configs/NAME.yaml under . or the repo root."""
    direct = pathlib.Path(name)
    if direct.is_file():
        return direct
    for root in (pathlib.Path.cwd(), REPO_ROOT):
        for cand in (f"eval_{name}.yaml", f"{name}.yaml", name):
            path = root / "configs" / cand
            if path.is_file():
                return path
    raise FileNotFoundError(f"config {name!r} is not a file, nor configs/eval_{name}.yaml")


def load_config(name: str) -> dict[str, Any]:
    import yaml

    path = find_config(name)
    cfg = yaml.safe_load(path.read_text()) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"config {path} must be a YAML mapping")
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"config {path}: unknown key(s) {unknown}; valid keys: {sorted(DEFAULTS)}")
    return cfg


def available_policies() -> list[str]:
    """Registered policy names from `kvjax.policies.available()`, or [] (with a warning) if unavailable."""
    try:
        from kvjax.policies import available

        return sorted(available())
    except Exception as err:  # the policies package may be absent or broken in this installation
        warnings.warn(f"kvjax.policies.available() is not usable ({type(err).__name__}: {err}); "
                      "only the full cache will run")
        return []


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser,
            policies: list[str] | None = None) -> dict[str, Any]:
    """Defaults < config file < command line; validated. ``policies``: the valid policy names."""
    from kvjax.eval.tasks import resolve_tasks

    cfg = dict(DEFAULTS)
    if args.config:
        try:
            cfg.update(load_config(args.config))
        except (FileNotFoundError, ValueError) as err:
            parser.error(str(err))
    cli = {
        "model": args.model, "tasks": _csv(args.tasks), "policies": _csv(args.policies),
        "compression_ratios": _floats(args.compression_ratios, "--compression-ratios", parser),
        "budgets": _ints(args.budgets, "--budgets", parser), "context_length": args.context_length,
        "num_samples": args.num_samples, "seed": args.seed, "out": args.out, "query_aware": args.query_aware,
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "words": args.words,
        "niah_lengths": _ints(args.niah_lengths, "--niah-lengths", parser),
        "niah_depths": _floats(args.niah_depths, "--niah-depths", parser),
        "niah_haystack": args.niah_haystack, "fidelity_tokens": args.fidelity_tokens, "lookahead": args.lookahead,
        "lookahead_options": _lookahead_options(getattr(args, "lookahead_option", None), parser),
        "prefill_chunk": getattr(args, "prefill_chunk", None), "cache_layout": getattr(args, "cache_layout", None),
        "kv_quant": _csv(getattr(args, "kv_quant", None)),
    }
    if args.budgets is not None and args.compression_ratios is None:
        cli["compression_ratios"] = []
    cfg.update({k: v for k, v in cli.items() if v is not None})
    data = dict(cfg.get("data") or {})
    for item in args.data or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--data takes NAME=PATH, got {item!r}")
        data[name] = path
    cfg["data"] = data

    try:
        cfg["tasks"] = resolve_tasks(list(cfg["tasks"]))
    except ValueError as err:
        parser.error(str(err))
    valid = available_policies() if policies is None else sorted(policies)
    names = list(cfg["policies"] or [])
    if names == ["none"]:  # the full-cache baseline alone
        names = []
    # a group holds lookahead_kv and its compositions only when there is an adapter for them
    has_adapter: list[bool] = []  # whether there is one, looked up once when a group needs to know

    def runnable(name: str) -> bool:
        if name not in LOOKAHEAD_PRESETS:
            return True
        if not has_adapter:
            has_adapter.append(_lookahead_adapter(cfg) is not None)
        return has_adapter[0]

    for group, members in (("all", valid), ("default", DEFAULT_POLICIES)):  # named groups of presets
        if group in names:
            names = [n for n in names if n != group] + [
                v for v in valid if v in members and v not in names and runnable(v)]
    canonical, unknown = [], []
    for n in names:  # any spelling kvjax.policies accepts ("SnapKV", "snap_kv", "SnapKVPress"): one name
        try:
            canonical.append(canonical_name(n, valid))
        except ValueError:
            near = close_match(n, valid)
            unknown.append(repr(n) + (f" (did you mean {near!r}?)" if near else ""))
    if unknown:
        parser.error(f"unknown policy(ies) {', '.join(unknown)}. Valid policies: "
                     f"{', '.join(valid) if valid else '(none registered)'}; or 'default', 'all', or 'none'")
    cfg["policies"] = list(dict.fromkeys(canonical))
    try:
        for r in cfg["compression_ratios"]:
            check_budget(None, r)
        for b in cfg["budgets"]:
            check_budget(b, None)
    except (TypeError, ValueError) as err:
        parser.error(f"--compression-ratios / --budgets: {err}")
    cfg["kv_quant"] = check_kv_quant(cfg["kv_quant"], parser)
    for key in ("context_length", "batch_size", "fidelity_tokens"):
        if int(cfg[key]) <= 0:
            parser.error(f"--{key.replace('_', '-')} must be positive, got {cfg[key]}")
    if cfg["prefill_chunk"] is not None and int(cfg["prefill_chunk"]) <= 0:
        parser.error(f"--prefill-chunk must be positive, got {cfg['prefill_chunk']}")
    if int(cfg["num_samples"]) < 0:
        parser.error(f"--num-samples must be >= 0, got {cfg['num_samples']}")
    if cfg["max_new_tokens"] is not None and int(cfg["max_new_tokens"]) <= 0:
        parser.error(f"--max-new-tokens must be positive, got {cfg['max_new_tokens']}")
    if cfg["out"] is None:
        tag = pathlib.Path(str(cfg["model"]).rstrip("/")).name or "model"
        mode = "query-aware" if cfg["query_aware"] else "query-agnostic"
        chunk = "" if cfg["prefill_chunk"] is None else f"_chunk{cfg['prefill_chunk']}"
        layout = "" if cfg["cache_layout"] == "dense" else f"_{cfg['cache_layout']}"
        cfg["out"] = str(pathlib.Path("out") / "eval" /
                         f"{tag}_L{cfg['context_length']}_{mode}_seed{cfg['seed']}{chunk}{layout}")
    return cfg


def check_kv_quant(value: Any, parser: argparse.ArgumentParser) -> list[str]:
    """The `kv_quant` storages (a list, or one comma-separated string in a config file), each "none" or a
    preset name of `kvjax.kv_quant.PRESETS`, duplicates dropped; an unknown one is a usage error listing
    the accepted names."""
    names = _csv([value] if isinstance(value, str) else [str(v) for v in value or []])
    accepted = ["none", *KV_QUANT_PRESETS]
    unknown = [n for n in names if n not in accepted]
    if unknown:
        parser.error(f"--kv-quant (config key kv_quant): unknown storage(s) {', '.join(repr(n) for n in unknown)}; "
                     f"accepted: {', '.join(accepted)} ('none': the model dtype; the others: kvjax.kv_quant.PRESETS)")
    if not names:
        parser.error(f"--kv-quant (config key kv_quant) needs at least one storage; accepted: {', '.join(accepted)}")
    return list(dict.fromkeys(names))


def _lookahead_options(items: list[str] | None, parser: argparse.ArgumentParser) -> dict[str, Any] | None:
    """--lookahead-option NAME=VALUE items -> {name: value}, checked against `LookaheadConfig`."""
    if not items:
        return None
    from kvjax.lookahead import LookaheadConfig

    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in LOOKAHEAD_OPTIONS:
            parser.error(f"--lookahead-option {item!r}: expected NAME=VALUE with NAME one of {LOOKAHEAD_OPTIONS}")
        out[name] = _option_value(name, value)
    try:
        LookaheadConfig(**out)
    except (TypeError, ValueError) as err:
        parser.error(f"--lookahead-option: {err}")
    return out


def _option_value(name: str, value: str) -> Any:
    """A --lookahead-option value as LookaheadConfig takes it: ints, tail_weight a float, "none" None (a
    malformed number stays a string, for the config's check to name)."""
    if value == "none":
        return None
    try:
        if name in ("kernel", "pool_offset", "bridge", "tail", "protect_last", "window"):
            return int(value)
        if name in ("tail_weight", "window_weight"):
            return float(value)
    except ValueError:
        pass
    return value


def _lookahead_adapter(cfg: dict[str, Any], required: bool = False) -> Any:
    """The adapter `lookahead_kv` and its compositions run with (--lookahead, else the bundled one), its
    inference-time fields replaced by cfg["lookahead_options"]; None if there is none."""
    from kvjax.lookahead import load

    try:
        adapter = load(cfg["lookahead"] or "bundled")
    except (FileNotFoundError, ValueError):
        if required or cfg["lookahead"]:
            raise
        return None
    options = dict(cfg.get("lookahead_options") or {})
    if bad := sorted(set(options) - set(LOOKAHEAD_OPTIONS)):
        raise ValueError(f"lookahead_options: {bad} cannot change after training; accepted: {LOOKAHEAD_OPTIONS}")
    return adapter.replace(config=dataclasses.replace(adapter.config, **options)) if options else adapter


def _check_identity(out: pathlib.Path, cfg: dict[str, Any], parser: argparse.ArgumentParser) -> None:
    path = out / "run_config.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    was = {k: old.get(k, DEFAULTS.get(k)) for k in RUN_IDENTITY}  # a key added later: its default then
    diff = [f"{k}: {was[k]!r} there, {cfg[k]!r} now" for k in RUN_IDENTITY if was[k] != cfg[k]]
    if diff:
        parser.error(f"--out {out} holds results of a different run ({'; '.join(diff)}); "
                     "pass another --out or delete that folder")


def list_everything(policies: list[str]) -> str:
    from kvjax.eval.tasks import SUITES, TASKS

    lines = ["tasks:"] + [f"  {t:28s} {info.description}" for t, info in TASKS.items()]
    lines += ["suites:"] + [f"  {s:28s} {', '.join(ts)}" for s, ts in SUITES.items()]
    lines += ["policies:", "  " + (", ".join(policies) if policies else "(none registered)")]
    return "\n".join(lines)


def check_positions(cfg: dict[str, Any], limit: int | None, where: str, parser: argparse.ArgumentParser) -> None:
    """Refuses a context length (or needle-grid length) beyond the model's positions."""
    if limit is None:
        return
    longest = max([int(cfg["context_length"])] + [int(n) for n in cfg["niah_lengths"] or []])
    if longest > limit:
        parser.error(f"--context-length {cfg['context_length']}"
                     + (f" (or --niah-lengths up to {longest})" if longest != int(cfg["context_length"]) else "")
                     + f" needs {longest} positions, more than the model allows (max_position_embeddings={limit} "
                     f"in {where}); pass --context-length {limit} or less")


def resume_command(argv: list[str], out: pathlib.Path) -> str:
    """The command line that resumes this run: the same arguments, and --out if it was implicit."""
    named = any(a == "--out" or a.startswith("--out=") for a in argv)
    return shlex.join(["python", "-m", "kvjax.eval", *argv, *([] if named else ["--out", str(out)])])


def main(argv: list[str] | None = None, *, generate_fn=None, logits_fn=None, tokenizer=None,
         policies: list[str] | None = None) -> int:
    """Runs the CLI. Tests inject ``generate_fn`` / ``logits_fn`` / ``tokenizer`` / ``policies``;
    without ``generate_fn`` the model is loaded and driven through `kvjax.generate`.
    Returns the exit status: 0, or 130 after Ctrl-C (finished samples stay in results.jsonl)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(list_everything(available_policies() if policies is None else sorted(policies)))
        return 0
    cfg = resolve(args, parser, policies)
    out = pathlib.Path(cfg["out"])
    _check_identity(out, cfg, parser)
    try:
        return _run(cfg, out, parser, args, generate_fn=generate_fn, logits_fn=logits_fn, tokenizer=tokenizer)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished samples are kept in {out / 'results.jsonl'}; resume with: "
              f"{resume_command(argv, out)}", file=sys.stderr)
        return 130


def compilation_cache_setting(option: str | None) -> str | None:
    """The cache folder `--compilation-cache` asks for, else $KVJAX_COMPILATION_CACHE, else None (the
    default folder); "off" turns the cache off (the test suite sets the variable to "off", so that
    in-process runs never write to the user's cache)."""
    return option or os.environ.get("KVJAX_COMPILATION_CACHE") or None


def _run(cfg: dict[str, Any], out: pathlib.Path, parser: argparse.ArgumentParser, args: argparse.Namespace, *,
         generate_fn, logits_fn, tokenizer) -> int:
    from kvjax.eval import runner
    from kvjax.data.prompts import chat_overhead
    from kvjax.eval.tasks import TASKS, TaskSkipped, generate_task

    if generate_fn is None:
        from kvjax.compilation_cache import enable_compilation_cache
        from kvjax.eval import engine

        cache_dir = compilation_cache_setting(args.compilation_cache)
        if cache_dir != "off":
            enable_compilation_cache(cache_dir)
        try:  # the model's positions from its config file, before loading anything
            check_positions(cfg, *engine.model_positions(cfg["model"]), parser)
            model = engine.load(cfg["model"])
        except (FileNotFoundError, ValueError) as err:
            parser.error(str(err))
        check_positions(cfg, model.config.max_position_embeddings, str(model.path), parser)
        tokenizer = model.tokenizer
        generate_fn = engine.make_generate_fn(model, pad_to=int(cfg["batch_size"]),
                                               cache_layout=cfg["cache_layout"]) if tokenizer is not None else None
        logits_fn = logits_fn or engine.make_logits_fn(model)

    overhead = chat_overhead(tokenizer)
    samples: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    for task in cfg["tasks"]:
        options: dict[str, Any] = {}
        if task == "niah_grid":
            options = {"lengths": cfg["niah_lengths"], "depths": cfg["niah_depths"], "haystack": cfg["niah_haystack"]}
        elif task == "fidelity":
            options = {"continuation_tokens": cfg["fidelity_tokens"]}
        try:
            made = generate_task(task, tokenizer, int(cfg["context_length"]), int(cfg["num_samples"]),
                                 seed=int(cfg["seed"]), overhead=overhead, data=cfg["data"], words=cfg["words"],
                                 **options)
        except TaskSkipped as why:
            skipped[task] = str(why)
            print(f"skipping {task}: {why}", file=sys.stderr)
            continue
        if cfg["max_new_tokens"] is not None:
            for s in made:
                s["max_new_tokens"] = min(s["max_new_tokens"], int(cfg["max_new_tokens"]))
        if made:
            samples[task] = made
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    names: list[Any] = list(cfg["policies"])
    if LOOKAHEAD_PRESETS & set(names):
        from kvjax.policies import get

        try:
            adapter = _lookahead_adapter(cfg, required=True)
        except (FileNotFoundError, ValueError) as err:
            parser.error(str(err))
        names = [get(n, adapter=adapter) if n in LOOKAHEAD_PRESETS else n for n in names]
    if cfg["prefill_chunk"] is not None:  # policies without chunked prefill are left out, saying why
        from kvjax.policies import resolve as resolve_policy

        kept = []
        for n in names:
            why = resolve_policy(n).chunked_prefill_unsupported()
            if why is None:
                kept.append(n)
            else:
                print(f"skipping {n if isinstance(n, str) else resolve_policy(n).name}: no chunked prefill ({why})",
                      file=sys.stderr)
        names = kept
    settings = runner.make_settings(names, cfg["compression_ratios"], cfg["budgets"],
                                    prefill_chunk=cfg["prefill_chunk"], kv_quant=cfg["kv_quant"])
    if share_shapes := getattr(generate_fn, "share_shapes", None):
        share_shapes([s for task, made in samples.items() if TASKS[task].metric != "fidelity" for s in made],
                     bool(cfg["query_aware"]))
    rows = runner.run(samples, settings, out, metrics={t: TASKS[t].metric for t in samples},
                      generate_fn=generate_fn, logits_fn=logits_fn, query_aware=bool(cfg["query_aware"]),
                      batch_size=int(cfg["batch_size"]), progress=not args.no_progress)
    mode = "query-aware" if cfg["query_aware"] else "query-agnostic"
    title = f"{cfg['model']}, context {cfg['context_length']}, {mode}"
    write_reports(out, rows, list(samples), settings, skipped=skipped, title=title)
    print(f"results in {out}")
    return 0
