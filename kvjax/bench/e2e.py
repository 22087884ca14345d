"""``python -m kvjax.bench e2e``: one whole request (long prompt, SnapKV, greedy answer), kvjax beside
kvpress on the same weights, warm and cold.

One random-weight Llama (the options' size) is built in kvjax and written as a Hugging Face checkpoint
(`kvjax.models.export.save_hf`); both sides load that folder, float32. The request follows kvpress's
"kv-press-text-generation" pipeline: a context of ``--context-tokens`` random ids is prefilled and
compressed by SnapKV at ``--compression-ratio`` (kvpress: ``SnapKVPress``; kvjax: the `snapkv_kvpress`
preset, its semantics), then a question of ``--question-tokens`` ids is fed against the compressed cache
and ``--new-tokens`` tokens are decoded greedily, no stop token (question-agnostic: the question is not
seen by the compression). ``--question-tokens 0`` is a plain prompt instead (kvpress:
``with press(model): model.generate(...)``; kvjax: `kvjax.generate` without questions).

Each side runs in its own process (`kvjax.bench._e2e_kvjax`, `kvjax.bench._e2e_worker`); kvpress's
under ``--kvpress-python``, a Python with kvpress installed (it pins an older transformers, so usually a
separate venv). Measured:

- cold: a fresh process's first request, compile (kvjax) and first-run costs included; also the whole
  process, start to first answer (interpreter, imports, checkpoint load). kvjax twice: with an empty
  persistent compilation cache (`kvjax.enable_compilation_cache` on a new folder) and then, in another
  fresh process, with the cache the first one wrote;
- warm: the median of ``--repeats`` further requests in the processes of the first cold runs, kvpress
  and kvjax alternating (one runs while the other waits), so that load on the machine falls on both alike;
- parity: the greedy tokens of the two sides, position by position.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

import kvjax
from kvjax.bench import _e2e_kvjax, _e2e_worker
from kvjax.bench._timing import header_lines, markdown_table
from kvjax.bench.overhead import bench_config
from kvjax.bench.prefill import cpu_name, load_average
from kvjax.models.export import init_params, save_hf

HELP = "one whole request (4K prompt, SnapKV 0.5, 32 greedy tokens) vs kvpress on the same weights: warm and cold"
GOALS = {"warm": 0.6, "cold": 1.2}  # issue 14: kvjax / kvpress at most


class Worker:
    """A worker process (`kvjax.bench._e2e_worker`'s protocol): started, ready, then one request per `run()`."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.ready = self._read("ready")
        self.first_answer_s: float | None = None

    def _read(self, event: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"worker {' '.join(self.proc.args[:4])} ... exited ({code}) before '{event}'; "
                               "its stderr is above")
        msg = json.loads(line)
        if msg.get("event") != event:
            raise RuntimeError(f"worker sent {msg} while '{event}' was expected")
        return msg

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        msg = self._read("result")
        if self.first_answer_s is None:
            self.first_answer_s = time.perf_counter() - self.started
        return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=60)


def kvjax_cmd(model: pathlib.Path, request: pathlib.Path, cache_dir: pathlib.Path) -> tuple[list[str], dict]:
    """The kvjax worker, run by this Python on this very kvjax (its root first on PYTHONPATH), by path like
    kvpress's so that its imports (jax, kvjax) are timed inside the process."""
    root = str(pathlib.Path(kvjax.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return [sys.executable, "-P", _e2e_kvjax.__file__, "--model", str(model), "--request", str(request),
            "--cache-dir", str(cache_dir)], env


def kvpress_cmd(python: str, model: pathlib.Path, request: pathlib.Path, threads: int) -> list[str]:
    """The kvpress worker, run by path (-P: its folder is not put on sys.path) so that it imports no jax."""
    return [python, "-P", _e2e_worker.__file__, "--model", str(model), "--request", str(request),
            "--threads", str(threads)]


def kvpress_available(python: str | None) -> str | None:
    """None if `python` imports kvpress, else why not (the kvpress side is then skipped)."""
    if not python:
        return "no --kvpress-python given (a Python with kvpress installed, e.g. a venv's bin/python)"
    try:
        done = subprocess.run([python, "-c", "import kvpress"], capture_output=True, text=True, timeout=300,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} could not be run: {e}"
    if done.returncode != 0:
        return f"{python} cannot import kvpress: {done.stderr.strip().splitlines()[-1:]}"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-tokens", type=int, default=4096, help="prompt (context) length")
    parser.add_argument("--question-tokens", type=int, default=32,
                        help="question fed after the compressed context (kvpress's pipeline); 0: a plain prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated")
    parser.add_argument("--compression-ratio", type=float, default=0.5, help="SnapKV's fraction of the context removed")
    parser.add_argument("--hidden", type=int, default=512, help="model width")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="warm requests per side (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU count)")
    parser.add_argument("--kvpress-python", default=None,
                        help="a Python with kvpress installed (e.g. a venv's bin/python); without it kvpress is "
                             "skipped")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="folder for the checkpoint, request and compilation cache (default: a temporary one)")
    parser.add_argument("--note", default=None, help="a line added to the report's header")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the markdown report here")


def write_inputs(args: argparse.Namespace, folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, dict]:
    """The random Llama as a HF checkpoint folder and the request as JSON, under `folder`."""
    total = args.context_tokens + args.question_tokens + args.new_tokens
    cfg = bench_config(argparse.Namespace(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                          kv_heads=args.kv_heads, lengths=[total], dtype="float32"))
    model = folder / "model"
    save_hf(model, init_params(cfg, jax.random.PRNGKey(0)), cfg)
    rng = np.random.RandomState(0)
    request = dict(context=rng.randint(3, cfg.vocab_size, args.context_tokens).tolist(),
                   question=rng.randint(3, cfg.vocab_size, args.question_tokens).tolist(),
                   max_new_tokens=args.new_tokens, compression_ratio=args.compression_ratio, policy="snapkv_kvpress")
    path = folder / "request.json"
    path.write_text(json.dumps(request))
    return model, path, dict(cfg=cfg, request=request)


def measure(args: argparse.Namespace, folder: pathlib.Path) -> dict:
    """Cold runs, then warm alternating runs; returns every number and both sides' tokens."""
    model, request, inputs = write_inputs(args, folder)
    threads = args.threads or os.cpu_count() or 1
    skip = kvpress_available(args.kvpress_python)
    if skip:
        print(f"kvpress side skipped: {skip}", flush=True)
    cache = folder / "jax-cache"
    shutil.rmtree(cache, ignore_errors=True)  # the first kvjax process starts on an empty compilation cache
    res: dict = dict(inputs=inputs, threads=threads, kvpress_skipped=skip, cold={}, warm={}, tokens={})
    workers: dict[str, Worker] = {}
    try:
        cmd, env = kvjax_cmd(model, request, cache)
        starts = {} if skip else {"kvpress": lambda: Worker(kvpress_cmd(args.kvpress_python, model, request, threads))}
        starts["kvjax"] = lambda: Worker(cmd, env)
        for name, start in starts.items():  # one at a time: a cold process never waits on the other side
            workers[name] = worker = start()
            first = worker.run()
            res["tokens"][name] = first["tokens"]
            res["cold"][name] = dict(worker.ready, first_s=first["seconds"], total_s=worker.first_answer_s)
            print(f"cold {name}: {res['cold'][name]}", flush=True)
        warm_cache = Worker(cmd, env)  # a fresh process reading the compilation cache the first one wrote
        try:
            again = warm_cache.run()
        finally:
            warm_cache.close()
        res["cold"]["kvjax, warm cache"] = dict(warm_cache.ready, first_s=again["seconds"],
                                                total_s=warm_cache.first_answer_s)
        res["tokens_stable"] = again["tokens"] == res["tokens"]["kvjax"]
        print(f"cold kvjax, warm compilation cache: {res['cold']['kvjax, warm cache']}", flush=True)
        times: dict[str, list[float]] = {name: [] for name in workers}
        for _ in range(args.repeats):
            for name, worker in workers.items():
                out = worker.run()
                times[name].append(out["seconds"])
                print(f"warm {name}: {out['seconds']:.3f} s", flush=True)
                res["tokens_stable"] &= out["tokens"] == res["tokens"][name]
        res["warm"] = {name: statistics.median(t) for name, t in times.items()}
        res["warm_all"] = times
        print(f"warm: {res['warm']}", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return res


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def report(args: argparse.Namespace, res: dict, load_start: str) -> str:
    cfg, cold, warm = res["inputs"]["cfg"], res["cold"], res["warm"]
    press = cold.get("kvpress", {})
    jx, jxw = cold["kvjax"], cold["kvjax, warm cache"]

    def seconds(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    rows = [
        [f"warm: whole request (median of {args.repeats})", seconds(warm.get("kvpress")), seconds(warm["kvjax"]),
         ratio(warm["kvjax"], warm.get("kvpress")), f"<= {GOALS['warm']}x"],
        ["cold, empty compilation cache: first request", seconds(press.get("first_s")), seconds(jx["first_s"]),
         ratio(jx["first_s"], press.get("first_s")), f"<= {GOALS['cold']}x"],
        ["cold, warm compilation cache: first request", seconds(press.get("first_s")), seconds(jxw["first_s"]),
         ratio(jxw["first_s"], press.get("first_s")), f"<= {GOALS['cold']}x"],
        ["cold, empty cache: process start to first answer", seconds(press.get("total_s")), seconds(jx["total_s"]),
         ratio(jx["total_s"], press.get("total_s")), ""],
        ["cold, warm cache: process start to first answer", seconds(press.get("total_s")), seconds(jxw["total_s"]),
         ratio(jxw["total_s"], press.get("total_s")), ""],
    ]
    cold_rows = [[name, seconds(c["import_s"]), seconds(c["load_s"]), seconds(c["first_s"]), seconds(c["total_s"])]
                 for name, c in cold.items()]
    if res["kvpress_skipped"]:
        parity = f"not checked: kvpress side skipped ({res['kvpress_skipped']})"
    else:
        a, b = res["tokens"]["kvjax"], res["tokens"]["kvpress"]
        same = sum(x == y for x, y in zip(a, b))
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        parity = (f"{same} of {max(len(a), len(b))} greedy tokens equal position by position (first {prefix} "
                  f"identical){'; identical' if a == b else ''}")
    req = res["inputs"]["request"]
    protocol = (f"context {len(req['context'])} tokens compressed by SnapKV at compression_ratio "
                f"{args.compression_ratio}, then a question of {len(req['question'])} tokens fed against the "
                f"compressed cache (kvpress's `kv-press-text-generation` pipeline, `_forward` on token ids), "
                if req["question"] else
                f"a plain prompt of {len(req['context'])} tokens compressed by SnapKV at compression_ratio "
                f"{args.compression_ratio} (kvpress: `with press(model): model.generate(...)`), ")
    versions = f"kvjax side: {jx['versions']}"
    if press:
        versions += f"; kvpress side: {press['versions']} (python {args.kvpress_python})"
    lines = [
        "# End to end: one request, kvjax beside kvpress", "",
        *([f"- **{args.note}**"] if args.note else []),
        *header_lines(),
        (f"- machine: {cpu_name()}, {os.cpu_count()} CPU(s); torch threads {res['threads']}, XLA's CPU client: "
         f"every core; {versions}"),
        f"- load average (1, 5, 15 min) at start: {load_start}; at end: {load_average()}",
        (f"- model: random-weight Llama, {cfg.num_layers} layers, width {cfg.hidden_size}, MLP "
         f"{cfg.intermediate_size}, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads (head_dim {cfg.head_dim}), "
         f"vocab {cfg.vocab_size}, float32, one Hugging Face checkpoint folder loaded by both (transformers: sdpa "
         "attention); batch 1"),
        (f"- request: {protocol}then {args.new_tokens} greedy tokens, no stop token; kvjax: `kvjax.generate` "
         "with the `snapkv_kvpress` preset (kvpress's SnapKV: window 64, kernel 5, its budget rule)"),
        f"- tokens: {parity}; each side's tokens the same in every request: {res['tokens_stable']}",
        ("- cold = a fresh process's first request (kvjax: compile included); process start to first answer adds "
         "the interpreter, imports and checkpoint load. kvjax's empty cache: `kvjax.enable_compilation_cache` on a "
         "new folder; warm cache: another fresh process on the folder the first one wrote. warm = median over "
         "further requests in the first processes, kvpress and kvjax alternating"),
        "", markdown_table(["measurement", "kvpress s", "kvjax s", "kvjax / kvpress", "goal (issue 14)"], rows), "",
        "Cold processes, seconds:", "",
        markdown_table(["process", "imports", "checkpoint load", "first request", "start to first answer"], cold_rows),
        ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.context_tokens <= 64:
        raise SystemExit("--context-tokens must exceed SnapKV's window of 64")
    load_start = load_average()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        res = measure(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory() as folder:
            res = measure(args, pathlib.Path(folder))
    text = report(args, res, load_start)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0
