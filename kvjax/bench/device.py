"""``python -m kvjax.bench device``: one command that proves kvjax on a GPU or TPU (issue 28).

Run it from the repository root on the machine with the accelerator::

    python -m kvjax.bench device            # GPU / TPU: full sizes, at most 8 minutes
    python -m kvjax.bench device --tiny     # any backend: tiny sizes, about a minute on a CPU

It writes one Markdown report, ``eval/device/<device kind>.md`` (e.g. ``eval/device/nvidia-h100-80gb-hbm3.md``;
``eval/device/cpu.md`` on a CPU; ``--out`` names another file), and prints each part's rows as they come.
On a CPU it runs in CPU mode: the tiny sizes, no accelerator tests.

The parts, each with its own time budget (seconds: `BUDGETS`; together at most ``--total-seconds``, 480):

1. ``pytest``: the accelerator's own tests, ``python -m pytest -m gpu_only`` (or ``tpu_only``) over the test
   files that carry the marker, in a subprocess (CPU mode: none, and the report says so);
2. ``kernels``: the kernel table of ``python -m kvjax.bench kernels`` (`kvjax.bench.kernels`: each scoring
   kernel beside its XLA reference), with the fraction of the device's peak memory bandwidth reached
   (bytes moved / time / peak; the peaks by device kind are `kvjax.bench._timing.PEAK_BANDWIDTH_GBPS`,
   "unknown" for a kind not in it);
3. ``throughput``: prefill and decode tokens/s of a 1B-class random Llama in bfloat16 (16 layers, width 2048,
   32 query / 8 KV heads, head_dim 64, vocab 32000) at 8K and 32K prompt tokens, by ``kvjax.generate``, for
   the full cache, SnapKV (r=0.5), LookaheadKV (r=0.5; a fresh adapter sized for the model,
   `kvjax.lookahead.init_adapter`, given to the registry's ``lookahead_kv`` as the eval does) and the full
   cache in int4 (``kv_quant="int4"``);
4. ``torch``: the engine's prefill beside transformers' ``LlamaForCausalLM`` (``attn_implementation="sdpa"``)
   with the same weights (written by `kvjax.models.export.save_hf`), bfloat16, on the same device, tokens/s
   both, and the last position's logits of the two compared (bfloat16 at each length, float32 at a short one);
5. ``max_context``: the largest prompt the full cache's prefill fits, doubling from 8K until out of memory
   (caught) or a cap (1M tokens).

Each part runs in its own process (so that one part's memory, compiled programs or a hang cannot reach the
next; on a TPU only one process may hold the chip), started after the previous one ended, and is killed at
its budget (its own, plus what the parts before it left unused; the whole command stays within
``--total-seconds``); inside, it stops early when the next measurement would not fit what is left of its budget.
Either way the report says the part was cut short, and keeps the rows it finished. A part that raises is
reported as ``part N (name) failed: <error>`` and the next part runs.

``--tiny`` (automatic on a CPU) shrinks every size (2 layers, width 128, 256 / 512 tokens, the kernels'
``micro`` sizes, the context search from 256 to 1024), so that CI runs the whole command
(tests/test_bench_device.py). ``--fail-part NAME`` makes that part raise (for that test).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import generate, lookahead, policies
from kvjax.bench import _timing, kernels
from kvjax.bench.overhead import bench_config
from kvjax.bench.prefill import alternating_medians, cpu_name, load_average
from kvjax.engine import steps
from kvjax.models.export import init_params, save_hf
from kvjax.models.model import Model
from kvjax.sampling import Sampler

HELP = ("one command that proves kvjax on the present GPU or TPU: its tests, kernels vs XLA (% of peak "
        "bandwidth), 1B-model prefill / decode throughput, beside torch sdpa, the largest context; one report")
PARTS = ("pytest", "kernels", "throughput", "torch", "max_context")
TITLES = {
    "pytest": "Accelerator tests (pytest -m gpu_only / tpu_only)",
    "kernels": "Scoring kernels vs their XLA reference",
    "throughput": "Prefill and decode throughput (kvjax.generate)",
    "torch": "Prefill beside transformers (torch sdpa), same weights",
    "max_context": "Largest context that fits (full-cache prefill)",
}
# Seconds per part (the environment probe included); they sum to at most TOTAL_SECONDS.
BUDGETS = {"env": 35, "pytest": 120, "kernels": 40, "throughput": 135, "torch": 70, "max_context": 70}
TOTAL_SECONDS = 480
REPO = pathlib.Path(__file__).resolve().parents[2]  # the checkout this kvjax is imported from

SIZES = {
    "full": dict(layers=16, hidden=2048, heads=32, kv_heads=8, vocab=32000, lengths=(8192, 32768), new_tokens=64,
                 repeats=3, kernel_sizes="production", kernel_repeats=5, context_start=8192, context_cap=2**20,
                 parity_tokens=512),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, lengths=(256, 512), new_tokens=16,
                 repeats=2, kernel_sizes="micro", kernel_repeats=2, context_start=256, context_cap=1024,
                 parity_tokens=256),
}


# --------------------------------------------------------------------------------------------------
# Worker side: one part in its own process (`python -m kvjax.bench.device --worker PART ...`)
# --------------------------------------------------------------------------------------------------

class Emitter:
    """Writes the part's results as JSON lines to a file, flushed at once (rows survive a kill)."""

    def __init__(self, path: pathlib.Path):
        self.file = open(path, "a")

    def __call__(self, kind: str, **data: Any) -> None:
        self.file.write(json.dumps({"kind": kind, **data}) + "\n")
        self.file.flush()


class Clock:
    """The part's deadline (epoch seconds): what is left, and whether a step of `seconds` fits."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def left(self) -> float:
        return self.deadline - time.time()

    def allows(self, seconds: float) -> bool:
        return seconds <= self.left()


def build_model(sz: dict[str, Any], dtype: str = "bfloat16"):
    """The random-weight Llama of the size preset (`kvjax.bench.overhead.bench_config`: MLP 4 x width,
    head_dim = width / heads, RoPE theta 5e5), weights in `dtype`; positions up to the context search's
    cap (+ decode room) in every part, so that the parts' programs are the same (one compile, shared
    through the compilation cache)."""
    longest = sz["context_cap"]
    cfg = bench_config(argparse.Namespace(vocab=sz["vocab"], hidden=sz["hidden"], layers=sz["layers"],
                                          heads=sz["heads"], kv_heads=sz["kv_heads"], dtype=dtype,
                                          lengths=[longest + 256]))
    params = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), init_params(cfg, jax.random.PRNGKey(0)))
    return Model(config=cfg, params=params)


def model_line(cfg: Any) -> str:
    return (f"random-weight Llama, {cfg.num_layers} layers, width {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
            f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads (head_dim {cfg.head_dim}), vocab {cfg.vocab_size}")


def param_count(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def prompt_ids(length: int, vocab: int) -> list[int]:
    return [1] + np.random.RandomState(length).randint(3, vocab, length - 1).tolist()


def kvjax_prefill(model: Any, length: int) -> Callable[[], Any]:
    """The engine's jitted prefill of one prompt filling `length` tokens, full cache, nothing observed
    (as `python -m kvjax.bench prefill` times it); the call returns (first token, cache, observations,
    last logits [1, V]) when ready."""
    tokens = jnp.asarray([prompt_ids(length, model.config.vocab_size)], jnp.int32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]

    def call():
        return jax.block_until_ready(steps.prefill(
            model.params, tokens, positions, jax.random.PRNGKey(0), cfg=model.config, capacity=length,
            observe=steps.prefill_spec([None]), rope_mode="original", sampler=Sampler(), mesh=None))

    return call


def worker_env(emit: Emitter) -> None:
    """The environment: device, memory, versions."""
    device = jax.devices()[0]
    stats = {}
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 (not every backend has memory stats)
        pass

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    emit("env", platform=device.platform, device_kind=getattr(device, "device_kind", device.platform),
         describe=_timing.describe_device(), device_count=jax.device_count(),
         memory_bytes=stats.get("bytes_limit"), peak_gbps=_timing.peak_bandwidth_gbps(device),
         jax=jax.__version__, jaxlib=version("jaxlib"), torch=version("torch"),
         transformers=version("transformers"), python=platform.python_version(), cpu=cpu_name(),
         cpus=os.cpu_count())


def worker_kernels(sz: dict[str, Any], clock: Clock, emit: Emitter) -> None:
    """`python -m kvjax.bench kernels` at the preset's sizes, one case at a time (`kernels.run_cases`)."""
    impl = kernels.default_kernel_impl()
    peak = _timing.peak_bandwidth_gbps()
    emit("info", impl=impl, note=kernels.kernel_column_note(impl), sizes=sz["kernel_sizes"], peak_gbps=peak,
         repeats=sz["kernel_repeats"])
    cases = kernels.build_cases(sz["kernel_sizes"], kernels.OPS, jnp.bfloat16)
    slowest = 0.0
    for case in cases:
        if slowest and not clock.allows(slowest):
            emit("cut", text=f"{len(cases) - cases.index(case)} kernel case(s) not run: the slowest so far took "
                             f"{slowest:.0f} s, {max(clock.left(), 0):.0f} s of the budget left")
            return
        start = time.time()
        try:
            (row,) = kernels.run_cases([case], impl, sz["kernel_repeats"])
        except Exception as err:  # noqa: BLE001 (one case's failure is a row; the other cases run)
            traceback.print_exc()
            row = [case.op, case.shape, f"failed: {type(err).__name__}: {first_line(err)}"] + ["-"] * 5
        if peak is None and jax.default_backend() != "cpu" and row[6] == "n/a":
            row[6] = "unknown"  # an accelerator whose peak is not in _timing.PEAK_BANDWIDTH_GBPS
        emit("row", row=row)
        slowest = max(slowest, time.time() - start)


def worker_throughput(sz: dict[str, Any], clock: Clock, emit: Emitter) -> None:
    """kvjax.generate per setting and length: prefill (max_new_tokens=1) and decode (the difference with
    max_new_tokens=N, one compiled decode loop for both: decode_tokens=N)."""
    model = build_model(sz)
    cfg = model.config
    adapter = lookahead.init_adapter(model)
    settings = [
        ("full", dict()),
        ("snapkv r=0.5", dict(policy="snapkv", compression_ratio=0.5)),
        ("lookahead_kv r=0.5", dict(policy=policies.get("lookahead_kv", adapter=adapter), compression_ratio=0.5)),
        ("full, int4 KV", dict(kv_quant="int4")),
    ]
    n = sz["new_tokens"]
    emit("info", model=model_line(cfg), params=param_count(model.params), new_tokens=n, repeats=sz["repeats"],
         adapter=f"{adapter.config.n_tokens} lookahead tokens, LoRA rank {adapter.config.rank} on "
                 f"{', '.join(adapter.config.projections)}")
    previous: dict[str, tuple[int, float, float]] = {}
    for length in sz["lengths"]:
        prompt = prompt_ids(length, cfg.vocab_size)
        for label, kw in settings:
            if label in previous:  # this setting at the last length: its first call, and the runs scaled
                last_len, first_s, runs_s = previous[label]
                estimate = first_s + runs_s * (length / last_len) ** 2
                if not clock.allows(estimate):
                    emit("cut", text=f"{label} at {length} tokens and after not run: estimated {estimate:.0f} s "
                                     f"(from {last_len} tokens), {max(clock.left(), 0):.0f} s of the budget left")
                    return
            start = time.time()

            def gen(new_tokens: int, kw=kw, prompt=prompt):
                return generate(model, [prompt], max_new_tokens=new_tokens, decode_tokens=n, stop_tokens=[], **kw)

            out = gen(n)  # compiles the prefill, compression and decode programs
            first_s = time.time() - start
            t_prefill, t_all = alternating_medians([lambda: gen(1), lambda: gen(n)], sz["repeats"])
            decode = t_all - t_prefill
            emit("row", row=[length, label, f"{t_prefill * 1e3:.1f}", f"{length / t_prefill:,.0f}",
                             f"{decode / (n - 1) * 1e3:.2f}" if decode > 0 else "n/a",
                             f"{(n - 1) / decode:,.1f}" if decode > 0 else "n/a",
                             mib(out.cache_bytes), f"{float(out.kept[0]):,.0f}", f"{first_s:.1f}"])
            previous[label] = (length, first_s, time.time() - start - first_s)


def mib(nbytes: float) -> str:
    """MiB, three significant digits below 100."""
    x = nbytes / 2**20
    return f"{x:,.1f}" if x >= 100 else f"{x:.3g}"


def rel_diff(a: Any, b: Any) -> tuple[float, bool]:
    """max |a - b| / max |b| over the vocabulary, and whether the argmax agrees."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.abs(a - b).max() / np.abs(b).max()), bool(a.argmax() == b.argmax())


def worker_torch(sz: dict[str, Any], clock: Clock, emit: Emitter) -> None:
    """The engine's prefill and transformers' sdpa forward on the same weights, alternating (median)."""
    import torch
    import transformers

    model = build_model(sz)
    cfg = model.config
    backend = jax.default_backend()
    if backend == "gpu" and torch.cuda.is_available():
        where = "cuda"
    elif backend == "cpu":
        where = "cpu"
        torch.set_num_threads(os.cpu_count() or 1)
    else:
        where = "cpu"  # torch has no access to this accelerator: parity only, on the host
    timed = where == "cuda" or backend == "cpu"
    with tempfile.TemporaryDirectory() as folder:
        save_hf(folder, model.params, cfg)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                                attn_implementation="sdpa").eval().to(where)
    emit("info", model=model_line(cfg), torch=torch.__version__, transformers=transformers.__version__,
         torch_device=where, timed=timed, repeats=sz["repeats"],
         why=None if timed else (f"torch {torch.__version__} cannot use this {backend.upper()} "
                                 f"(torch.cuda.is_available() = {torch.cuda.is_available()}); a CUDA build of torch "
                                 "is needed on a GPU, and torch does not run on a TPU: the float32 logits check "
                                 "below ran torch on the host CPU"))

    def torch_forward(ids: Any) -> Callable[[], Any]:
        def call():
            with torch.no_grad():
                out = hf(ids, logits_to_keep=1).logits
            if where == "cuda":
                torch.cuda.synchronize()
            return out
        return call

    def ids_of(length: int) -> Any:
        return torch.tensor([prompt_ids(length, cfg.vocab_size)], device=where)

    # float32 first (the check that matters most): the same (bfloat16-valued) weights upcast on both sides
    length = sz["parity_tokens"]
    model32 = Model(config=dataclasses.replace(cfg, dtype="float32"),
                    params=jax.tree.map(lambda x: x.astype(np.float32), model.params))
    hf.float()
    with jax.default_matmul_precision("highest"):  # no bf16 / TF32 passes for float32 matmuls on TPU / GPU
        logits = kvjax_prefill(model32, length)()[3][0]
    diff, same = rel_diff(logits, torch_forward(ids_of(length))()[0, -1].float().cpu().numpy())
    emit("parity", dtype="float32", tokens=length, diff=diff, argmax_same=same)
    del model32
    hf.to(torch.bfloat16)
    if not timed:
        return
    slowest = 0.0
    for length in sz["lengths"]:
        if slowest and not clock.allows(slowest * 4):
            emit("cut", text=f"{length} tokens and after not run: the last length took {slowest:.0f} s, "
                             f"{max(clock.left(), 0):.0f} s of the budget left")
            break
        start = time.time()
        ours, theirs = kvjax_prefill(model, length), torch_forward(ids_of(length))
        t_ours, t_theirs = alternating_medians([ours, theirs], sz["repeats"])
        diff, same = rel_diff(ours()[3][0], theirs()[0, -1].float().cpu().numpy())
        emit("row", row=[length, f"{t_ours * 1e3:.1f}", f"{t_theirs * 1e3:.1f}", f"{length / t_ours:,.0f}",
                         f"{length / t_theirs:,.0f}", f"{t_theirs / t_ours:.2f}x"])
        emit("parity", dtype="bfloat16", tokens=length, diff=diff, argmax_same=same)
        slowest = time.time() - start


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Ran out of memory" in text


def worker_max_context(sz: dict[str, Any], clock: Clock, emit: Emitter) -> None:
    """Doubling the prompt of the full cache's prefill until it does not fit (the error caught) or the cap."""
    cap = sz["context_cap"]
    model = build_model(sz)
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize
    stats = jax.devices()[0].memory_stats
    emit("info", model=model_line(cfg), cap=cap, start=sz["context_start"],
         memory_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
    length, fitted, last = sz["context_start"], None, None
    while length <= cap:
        if last is not None:  # the last length's compile, and its run x 4 (attention is quadratic in the length)
            estimate = last[0] + 4 * last[1]
            if not clock.allows(estimate):
                emit("result", largest=fitted, stop=f"time budget: {length} tokens would take about {estimate:.0f} s, "
                                                    f"{max(clock.left(), 0):.0f} s left (not an out-of-memory)")
                emit("cut", text=f"the search stopped before {length} tokens (time budget)")
                return
        start = time.time()
        try:
            call = kvjax_prefill(model, length)
            call()  # compile + run
            first_s = time.time() - start
            run_s = None
            if clock.allows(first_s):
                t0 = time.perf_counter()
                call()
                run_s = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            if not is_oom(err):
                raise
            emit("row", row=[length, "out of memory", f"{time.time() - start:.1f}", "-", "-",
                             mib(length * per_token), "-"])
            emit("result", largest=fitted, stop=f"out of memory at {length} tokens: {first_line(err)}")
            return
        finally:
            call = None  # noqa: F841
            gc.collect()
        try:
            peak = (stats() or {}).get("peak_bytes_in_use")
        except Exception:  # noqa: BLE001
            peak = None
        emit("row", row=[length, "fits", f"{first_s:.1f}", "-" if run_s is None else f"{run_s:.2f}",
                         f"{length / run_s:,.0f}" if run_s else "-", mib(length * per_token),
                         "-" if peak is None else f"{peak / 2**30:.2f}"])
        fitted, last = length, ((first_s - run_s, run_s) if run_s is not None else (0.0, first_s))
        length *= 2
    emit("result", largest=fitted, stop=f"the cap of {cap} tokens reached (no out-of-memory below it)")


WORKERS = {"kernels": worker_kernels, "throughput": worker_throughput, "torch": worker_torch,
           "max_context": worker_max_context}


def worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax.bench.device")
    parser.add_argument("--worker", required=True, choices=("env", *WORKERS))
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    parser.add_argument("--events", type=pathlib.Path, required=True)
    parser.add_argument("--fail", action="store_true", help="raise at the start of the part (a test of the report)")
    args = parser.parse_args(argv)
    emit = Emitter(args.events)
    try:
        if args.fail:
            raise RuntimeError(f"injected failure (--fail-part {args.worker})")
        if args.worker == "env":
            worker_env(emit)
        else:
            WORKERS[args.worker](SIZES[args.size], Clock(args.deadline), emit)
    except BaseException as err:  # noqa: BLE001 (reported to the parent, then the exit status says so)
        traceback.print_exc()
        emit("error", error=f"{type(err).__name__}: {first_line(err)}")
        return 1
    emit("done")
    return 0


# --------------------------------------------------------------------------------------------------
# Parent side: the parts in turn, then the report
# --------------------------------------------------------------------------------------------------

class PartResult:
    def __init__(self, name: str, budget: float):
        self.name, self.budget = name, budget
        self.events: list[dict[str, Any]] = []
        self.status = "not run"
        self.error: str | None = None
        self.seconds = 0.0
        self.cut: list[str] = []

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def first(self, kind: str) -> dict[str, Any]:
        found = self.of(kind)
        return found[0] if found else {}


def run_process(cmd: list[str], *, budget: float, env: dict[str, str] | None = None, cwd: pathlib.Path | None = None,
                log: pathlib.Path | None = None) -> tuple[int | None, float]:
    """Runs `cmd` (its own process group), killed with its children at `budget` seconds; its output goes to
    ours, or to the file `log`. Returns (exit status, None when killed; seconds)."""
    start = time.time()
    with open(log, "w") if log else open(os.devnull) as sink:
        out = dict(stdout=sink, stderr=subprocess.STDOUT) if log else {}
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True, **out)
    try:
        rc = proc.wait(timeout=max(budget, 1.0))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        rc = None
    return rc, time.time() - start


def run_worker(name: str, *, size: str, budget: float, env: dict[str, str], fail: bool = False,
               python: str = sys.executable) -> PartResult:
    """One part in a worker process, killed at its budget; its events read back (also after a kill)."""
    result = PartResult(name, budget)
    margin = min(10.0, 0.1 * budget)
    with tempfile.TemporaryDirectory() as folder:
        events = pathlib.Path(folder) / "events.jsonl"
        events.touch()
        cmd = [python, "-m", "kvjax.bench.device", "--worker", name, "--size", size, "--deadline",
               f"{time.time() + budget - margin:.3f}", "--events", str(events)] + (["--fail"] if fail else [])
        rc, result.seconds = run_process(cmd, budget=budget, env=env, cwd=None)
        result.events = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    result.cut = [e["text"] for e in result.of("cut")]
    errors = result.of("error")
    if errors:
        result.status, result.error = "failed", errors[0]["error"]
    elif rc is None:
        result.status = "cut short"
        result.cut.append(f"killed at its budget of {budget:.0f} s (the rows above are what it finished)")
    elif rc != 0 or not result.of("done"):
        result.status, result.error = "failed", f"the worker process exited with status {rc} (see its stderr above)"
    else:
        result.status = "cut short" if result.cut else "ok"
    return result


def marker_files(marker: str, tests: pathlib.Path) -> list[pathlib.Path]:
    """Test files that use the marker (`pytest.mark.<marker>`, or a helper named after it), not those that
    only name it in a selection ("not gpu_only")."""
    pattern = re.compile(rf"(?<!not )\b{marker}\b")
    return sorted(p for p in tests.rglob("test_*.py") if pattern.search(p.read_text()))


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def parse_verbose(log: str) -> tuple[dict[str, int], list[str]]:
    """Counts per outcome from `pytest -v` lines ("tests/x.py::T::test PASSED [ 10%]"), and the failed ids:
    what finished, also when pytest was killed before its summary."""
    counts = dict.fromkeys(OUTCOMES, 0)
    failed = []
    for line in log.splitlines():
        m = re.match(rf"^(\S+::\S+) ({'|'.join(OUTCOMES)})\b", line)
        if m:
            counts[m.group(2)] += 1
            if m.group(2) in ("FAILED", "ERROR"):
                failed.append(m.group(1))
    return counts, failed


def run_pytest(platform_name: str, *, budget: float, env: dict[str, str], fail: bool = False) -> PartResult:
    """`python -m pytest -m gpu_only|tpu_only -v` over the files that carry the marker, killed at the budget;
    its output is kept in a log (and printed) and read back line by line."""
    result = PartResult("pytest", budget)
    start = time.time()
    try:
        if fail:
            raise RuntimeError("injected failure (--fail-part pytest)")
        if platform_name not in ("gpu", "tpu"):
            result.events.append({"kind": "info", "text": f"CPU mode: no gpu_only / tpu_only tests run (they need a "
                                                          f"GPU or TPU backend; this one is {platform_name})"})
            result.status = "ok"
            return result
        marker = f"{platform_name}_only"
        tests = REPO / "tests"
        files = marker_files(marker, tests) if tests.is_dir() else []
        if not files:
            raise RuntimeError(f"no test file under {tests} uses the marker {marker} (the tests ship with the "
                               "repository, not the package)")
        names = [str(f.relative_to(REPO)) for f in files]
        with tempfile.TemporaryDirectory() as folder:
            log = pathlib.Path(folder) / "pytest.log"
            # JAX_PLATFORMS="" (set): tests/conftest.py keeps it, so jax picks the accelerator, not the CPU.
            # The tests check values, not speed: XLA's GPU autotuning (seconds per program; the H200 run's first
            # tests took about 25 s each) is turned off for them.
            cmd = [sys.executable, "-m", "pytest", "-m", marker, "-v", "-p", "no:cacheprovider", *names]
            flags = " ".join(x for x in (env.get("XLA_FLAGS", ""), "--xla_gpu_autotune_level=0") if x)
            rc, _ = run_process(cmd, budget=budget, env={**env, "JAX_PLATFORMS": "", "XLA_FLAGS": flags}, cwd=REPO,
                                log=log)
            text = log.read_text(errors="replace") if log.exists() else ""
        print(text[-6000:], flush=True)
        counts, failed = parse_verbose(text)
        summary = [ln for ln in text.splitlines() if re.match(r"^=+ .*(passed|failed|skipped|error|deselected|no tests)"
                                                               r".* =+$", ln)]
        result.events.append({"kind": "info", "marker": marker, "files": names, "rc": rc, "counts": counts,
                              "failures": failed, "summary": summary[-1].strip("= ") if summary else None})
        if rc is None:
            result.status = "cut short"
            result.cut.append(f"pytest killed at its budget of {budget:.0f} s (the counts are the tests it finished)")
        elif rc in (0, 5):  # 5: no test collected (every test of the marker deselected)
            result.status = "ok"
        else:
            result.status, result.error = "failed", (f"pytest exited with status {rc}: {counts['FAILED']} failed, "
                                                     f"{counts['ERROR']} errors")
    except Exception as err:  # noqa: BLE001
        result.status, result.error = "failed", f"{type(err).__name__}: {err}"
    finally:
        result.seconds = time.time() - start
    return result


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def report_name(env: dict[str, Any]) -> str:
    """The report's file name: `cpu.md` on a CPU, else the device kind's slug (NVIDIA H100 80GB HBM3 ->
    nvidia-h100-80gb-hbm3.md)."""
    if not env or env.get("platform") == "cpu":
        return "cpu.md"
    return slug(env.get("device_kind", "device")) + ".md"


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------

def _table(columns: tuple[str, ...] | list[str], rows: list[list[Any]]) -> str:

    return _timing.markdown_table(columns, rows)


def render_pytest(r: PartResult) -> list[str]:
    info = r.first("info")
    if "text" in info:
        return [info["text"] + "."]
    if not info:
        return []
    c = info["counts"]
    lines = [f"`python -m pytest -m {info['marker']} -v` over {len(info['files'])} file(s) "
             f"({', '.join(info['files'])}); exit status {info['rc'] if info['rc'] is not None else 'none (killed)'}"
             + (f"; pytest's summary: {info['summary']}" if info.get("summary") else "") + ".", "",
             _table([o.lower() for o in OUTCOMES], [[c[o] for o in OUTCOMES]])]
    lines += [f"- failed: `{f}`" for f in info["failures"]]
    return lines


def render_kernels(r: PartResult, env: dict[str, Any]) -> list[str]:

    info = r.first("info")
    if not info:
        return []
    peak = info.get("peak_gbps")
    if env.get("platform") == "cpu":
        peak_text = "n/a on a CPU"
    elif peak is None:
        peak_text = f"unknown (device kind {env.get('device_kind')!r} is not in the table of peaks)"
    else:
        peak_text = f"{peak:,.0f} GB/s (spec sheet, by device kind)"
    return [f"Sizes `{info['sizes']}` (`python -m kvjax.bench kernels --sizes {info['sizes']}`), bfloat16 inputs, "
            f"median of {info['repeats']} runs after a compile run. Kernel column: `{info['impl']}` = {info['note']}. "
            f"Peak memory bandwidth: {peak_text}; % peak = bytes moved (one read of every input, one write of every "
            "output) / time / peak.", "", _table(kernels.COLUMNS, [e["row"] for e in r.of("row")])]


THROUGHPUT_COLUMNS = ("prompt tokens", "setting", "prefill ms", "prefill tok/s", "decode ms/token", "decode tok/s",
                      "decode cache MiB", "kept per head", "first call s")


def render_throughput(r: PartResult) -> list[str]:
    info = r.first("info")
    if not info:
        return []
    n = info["new_tokens"]
    return [f"Model: {info['model']} ({info['params'] / 1e6:,.1f}M parameters), bfloat16, batch 1. Each cell: "
            f"`kvjax.generate(model, [prompt], max_new_tokens=1 or {n}, decode_tokens={n}, stop_tokens=[])` "
            f"(greedy), median of {info['repeats']} alternating runs after a first call (compile); prefill = the "
            f"max_new_tokens=1 call (prefill, scoring, compression, quantization, first token); decode = the "
            f"difference of the two calls over {n - 1} tokens. LookaheadKV: a fresh adapter ({info['adapter']}, "
            "`kvjax.lookahead.init_adapter`), `kvjax.policies.get(\"lookahead_kv\", adapter=...)` as the eval "
            "builds it. Decode cache MiB: `GenerateOutput.cache_bytes`.", "",
            _table(THROUGHPUT_COLUMNS, [e["row"] for e in r.of("row")])]


def render_torch(r: PartResult) -> list[str]:
    info = r.first("info")
    if not info:
        return []
    lines = [f"Model: {info['model']}; torch {info['torch']} on `{info['torch_device']}`, transformers "
             f"{info['transformers']}, `attn_implementation=\"sdpa\"`, the weights written by kvjax "
             "(`kvjax.models.export.save_hf`) and read by `AutoModelForCausalLM.from_pretrained`. kvjax = the engine's "
             "jitted prefill (cache written, first token sampled); torch = `model(ids, logits_to_keep=1)` under "
             f"`torch.no_grad()` (synchronized); bfloat16, median of {info['repeats']} alternating runs after a "
             "warm-up run each.", ""]
    if info.get("why"):
        lines += [f"Timing not run: {info['why']}.", ""]
    rows = [e["row"] for e in r.of("row")]
    if rows:
        lines += [_table(("prompt tokens", "kvjax ms", "torch sdpa ms", "kvjax tok/s", "torch sdpa tok/s",
                          "kvjax speed-up"), rows), ""]
    parity = r.of("parity")
    if parity:
        lines += ["Last position's logits, kvjax against torch (the same weights; float32 = both upcast):", "",
                  _table(("dtype", "prompt tokens", "max abs diff / max abs logit", "same argmax"),
                         [[p["dtype"], p["tokens"], f"{p['diff']:.2e}", "yes" if p["argmax_same"] else "NO"]
                          for p in parity])]
    return lines


def render_max_context(r: PartResult) -> list[str]:
    info = r.first("info")
    if not info:
        return []
    fraction = info.get("memory_fraction")
    lines = [f"Model: {info['model']}, bfloat16, batch 1; the engine's prefill of the full cache (`capacity` = the "
             f"prompt), prompts doubling from {info['start']} tokens up to a cap of {info['cap']}; an out-of-memory "
             "error is caught and ends the search"
             + (f" (JAX may use {float(fraction):.0%} of the device memory: XLA_PYTHON_CLIENT_MEM_FRACTION)"
                if fraction else "") + ". First s = compile + run; run s = a second, compiled run.", "",
             _table(("prompt tokens", "status", "first s", "run s", "prefill tok/s", "KV cache MiB",
                     "peak device GiB"), [e["row"] for e in r.of("row")])]
    result = r.first("result")
    if result:
        largest = result["largest"]
        lines += ["", f"**Largest context that fits: {'none' if largest is None else f'{largest:,} tokens'}** "
                      f"(stopped by: {result['stop']})."]
    return lines


def render(results: dict[str, PartResult], env: dict[str, Any], *, size: str, command: str, started: float,
           total: float, cache: bool, env_error: str | None) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mode = "CPU mode (tiny sizes)" if env.get("platform") == "cpu" else ("tiny sizes (--tiny)" if size == "tiny"
                                                                          else "full sizes")
    memory = env.get("memory_bytes")
    kind = "CPU" if env.get("platform") == "cpu" else env.get("device_kind", "an unknown device")
    lines = [f"# kvjax on {kind}", ""]
    if env:
        lines += [f"- device: {env['describe']}" + (f"; memory JAX may use: {memory / 2**30:.1f} GiB (memory_stats "
                                                    "bytes_limit, with JAX's default allocator settings)"
                                                    if memory else ""),
                  f"- jax {env['jax']} (jaxlib {env['jaxlib']}), torch {env['torch']}, transformers "
                  f"{env['transformers']}, python {env['python']}",
                  f"- host: {env['cpu']}, {env['cpus']} CPU(s)"]
    else:
        lines += [f"- environment probe failed: {env_error}"]
    spent = sum(r.seconds for r in results.values())
    lines += [f"- recorded: {now}; {mode}; the parts took {spent:.0f} s of a {total:g} s budget "
              f"(the whole command {time.time() - started:.0f} s); load average at the end {load_average()}",
              "- each part runs in its own process, killed at its budget (its own + what the parts before left "
              "unused); "
              + ("compiled programs are shared between them through a temporary JAX persistent compilation cache "
                 "(a first call that finds its program there does not compile)" if cache else
                 "no compilation cache is shared between them (--no-compilation-cache)"),
              f"- command: `{command}`"]
    if env.get("platform") == "cpu":
        lines.append("- CPU mode shows that every part runs end to end (and that kvjax and torch agree on the same "
                     "weights); its times are those of a tiny model on this CPU and say nothing about an accelerator")
    lines += ["", "## Summary", "",
              _table(("part", "status", "seconds", "budget s"),
                     [[f"{i}. {name}", results[name].status if name in results else "not selected",
                       f"{results[name].seconds:.0f}" if name in results else "-",
                       f"{results[name].budget:.0f}" if name in results else "-"]
                      for i, name in enumerate(PARTS, 1)]), ""]
    renderers = {"pytest": render_pytest, "kernels": lambda r: render_kernels(r, env), "throughput": render_throughput,
                 "torch": render_torch, "max_context": render_max_context}
    failed = []
    for i, name in enumerate(PARTS, 1):
        lines += [f"## {i}. {TITLES[name]}", ""]
        r = results.get(name)
        if r is None:
            lines += ["Not selected (`--parts`).", ""]
            continue
        body = renderers[name](r)
        lines += body + ([""] if body else [])
        for text in r.cut:
            lines += [f"Part {i} ({name}) cut short: {text}.", ""]
        if r.status == "failed":
            failed.append(f"part {i} ({name}) failed: {r.error}")
            lines += [failed[-1], ""]
    lines += ["## Failed parts", ""] + ([f"- {f}" for f in failed] if failed else ["None."]) + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The subcommand
# --------------------------------------------------------------------------------------------------

def _parts(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or '(none given)'}; accepted: {', '.join(PARTS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (automatic on a CPU): about a minute")
    parser.add_argument("--parts", type=_parts, default=list(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--total-seconds", type=float, default=TOTAL_SECONDS,
                        help=f"the whole command's budget; the parts' budgets (seconds of {TOTAL_SECONDS}: {BUDGETS}) "
                             "scale with it")
    parser.add_argument("--no-compilation-cache", action="store_true",
                        help="do not share compiled programs between the parts' processes (a temporary JAX "
                             "persistent compilation cache, by default)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="the report's path (default: eval/device/<device kind>.md, from the current folder)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write every part's results as JSON")
    parser.add_argument("--fail-part", action="append", default=[], choices=PARTS,
                        help="make this part raise (to check that the report says so and the others run)")


def worker_environ(kind: str, platform_name: str, cache: str | None = None) -> dict[str, str]:
    """The worker's environment: this kvjax first on the path; `cache`: a JAX persistent compilation cache
    folder shared by the parts (the same prefill compiles once); on a GPU, JAX leaves room for torch in
    the torch part, and may use 95% of the memory in the context search."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    if platform_name == "gpu":
        if kind == "torch":
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        elif kind == "max_context":
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    return env


def command_line(args: argparse.Namespace) -> str:
    """The command of this run, its options as given (defaults left out)."""
    out = ["python -m kvjax.bench device"]
    if args.tiny:
        out.append("--tiny")
    if args.parts != list(PARTS):
        out.append(f"--parts {','.join(args.parts)}")
    if args.total_seconds != TOTAL_SECONDS:
        out.append(f"--total-seconds {args.total_seconds:g}")
    if args.no_compilation_cache:
        out.append("--no-compilation-cache")
    out += [f"--fail-part {name}" for name in args.fail_part]
    out += [f"--{k} {getattr(args, k)}" for k in ("out", "json") if getattr(args, k) is not None]
    return " ".join(out)


def run(args: argparse.Namespace) -> int:
    started = time.time()
    if args.total_seconds <= 0:
        raise SystemExit("--total-seconds must be positive")
    with tempfile.TemporaryDirectory(prefix="kvjax-device-") as folder:
        cache = None if args.no_compilation_cache else str(pathlib.Path(folder) / "jax-cache")
        results, env, size, probe = run_parts(args, cache)
    text = render(results, env, size=size, command=command_line(args), started=started, total=args.total_seconds,
                  cache=cache is not None, env_error=probe.error or "; ".join(probe.cut))
    out = args.out or pathlib.Path("eval") / "device" / report_name(env)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"report written to {out}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, "size": size, "report": str(out), "parts": {
            n: {"status": r.status, "error": r.error, "cut": r.cut, "seconds": r.seconds, "budget": r.budget,
                "events": r.events} for n, r in results.items()}}, indent=1) + "\n")
    return 0 if all(r.status != "failed" for r in results.values()) else 1


def run_parts(args: argparse.Namespace, cache: str | None
              ) -> tuple[dict[str, PartResult], dict[str, Any], str, PartResult]:
    """The probe, then each selected part in turn (each in try/except: a failure is a result, the next
    part runs). Returns the parts' results, the environment, the size preset and the probe's result."""
    started = time.time()
    deadline = started + args.total_seconds
    budgets = {k: v * args.total_seconds / TOTAL_SECONDS for k, v in BUDGETS.items()}
    fails = set(args.fail_part)
    # the probe: the parent never opens the accelerator itself (a TPU takes one process at a time; a GPU
    # would keep a share of its memory away from the parts)
    probe = run_worker("env", size="tiny", budget=budgets["env"], env=worker_environ("env", ""))
    env = probe.first("env")
    platform_name = env.get("platform", "unknown")
    size = "tiny" if args.tiny or platform_name == "cpu" else "full"
    if probe.status != "ok":
        print(f"environment probe failed: {probe.error or probe.cut}", flush=True)
    print(f"# device: {env.get('describe', 'unknown')}; sizes: {size}; parts: {', '.join(args.parts)}", flush=True)
    results: dict[str, PartResult] = {}
    spare = max(budgets["env"] - probe.seconds, 0.0)  # the seconds the parts before left unused pass to the next
    for i, name in enumerate(PARTS, 1):
        if name not in args.parts:
            continue
        budget = min(budgets[name] + spare, max(deadline - time.time(), 1.0))
        print(f"## part {i} ({name}): budget {budget:.0f} s", flush=True)
        try:
            environ = worker_environ(name, platform_name, cache)
            if name == "pytest":
                r = run_pytest(platform_name, budget=budget, env=environ, fail=name in fails)
            else:
                r = run_worker(name, size=size, budget=budget, env=environ, fail=name in fails)
        except Exception as err:  # noqa: BLE001 (the next part runs)
            r = PartResult(name, budget)
            r.status, r.error = "failed", f"{type(err).__name__}: {err}"
        results[name] = r
        spare = max(budget - r.seconds, 0.0)
        if r.status == "failed":
            print(f"part {i} ({name}) failed: {r.error}", flush=True)
        for text in r.cut:
            print(f"part {i} ({name}) cut short: {text}", flush=True)
        print(f"## part {i} ({name}): {r.status} in {r.seconds:.0f} s", flush=True)
    return results, env, size, probe


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
