"""``python -m kvjax.bench device`` (issue 28): its CPU mode end to end in a subprocess, a part that fails
or runs past its budget, the context search's stops, and the tables it reads (peaks, report names)."""

import json
import os
import pathlib
import subprocess
import sys
import time
import types

import pytest

from kvjax.bench import _timing, device

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The whole command in CPU mode, with the kernels part made to fail (--fail-part kernels); a budget
    large enough that load on a shared CI machine does not cut parts short."""
    folder = tmp_path_factory.mktemp("device")
    report, results = folder / "report.md", folder / "results.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "kvjax.bench", "device", "--fail-part", "kernels",
                           "--total-seconds", "1500", "--out", str(report), "--json", str(results)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=1700)
    return dict(rc=done.returncode, stdout=done.stdout, stderr=done.stderr, seconds=time.time() - start,
                report=report.read_text() if report.exists() else None,
                results=json.loads(results.read_text()) if results.exists() else None)


def test_cpu_mode_writes_every_part_and_reports_the_failed_one(cpu_run):
    out = cpu_run
    assert out["report"] is not None, out["stdout"][-3000:] + out["stderr"][-3000:]
    report, results = out["report"], out["results"]
    assert out["rc"] == 1  # a part failed
    assert results["size"] == "tiny" and results["env"]["platform"] == "cpu"
    for i, name in enumerate(device.PARTS, 1):
        assert f"## {i}. {device.TITLES[name]}" in report
    # the injected failure: one clear line (printed and in the report), and the other parts still ran
    line = "part 2 (kernels) failed: RuntimeError: injected failure (--fail-part kernels)"
    assert line in out["stdout"] and line in report and f"- {line}" in report.split("## Failed parts")[1]
    parts = results["parts"]
    assert parts["kernels"]["status"] == "failed"
    assert {n: parts[n]["status"] for n in ("pytest", "throughput", "torch", "max_context")} == dict.fromkeys(
        ("pytest", "throughput", "torch", "max_context"), "ok")
    assert "CPU mode: no gpu_only / tpu_only tests run" in report
    assert "| 2. kernels | failed |" in report and "| 3. throughput | ok |" in report


def test_throughput_rows_are_the_settings_that_ran(cpu_run):
    rows = [e["row"] for e in cpu_run["results"]["parts"]["throughput"]["events"] if e["kind"] == "row"]
    cells = {(r[0], r[1]): r for r in rows}
    settings = ("full", "snapkv r=0.5", "lookahead_kv r=0.5", "full, int4 KV")
    assert set(cells) == {(n, s) for n in device.SIZES["tiny"]["lengths"] for s in settings}
    for n in device.SIZES["tiny"]["lengths"]:
        kept = {s: float(cells[(n, s)][7].replace(",", "")) for s in settings}
        # the policies keep half the prompt per head; the full cache (in bf16 or int4) all of it
        assert kept["full"] == kept["full, int4 KV"] == n and kept["snapkv r=0.5"] == kept["lookahead_kv r=0.5"] == n / 2
        mib = {s: float(cells[(n, s)][6].replace(",", "")) for s in settings}
        assert mib["full, int4 KV"] < mib["full"]
        assert all(float(cells[(n, s)][3].replace(",", "")) > 0 for s in settings)  # prefill tok/s


def test_kvjax_and_torch_prefill_of_the_same_weights_agree(cpu_run):
    events = cpu_run["results"]["parts"]["torch"]["events"]
    parity = {(p["dtype"], p["tokens"]): p for p in events if p["kind"] == "parity"}
    tiny = device.SIZES["tiny"]
    assert set(parity) == {("float32", tiny["parity_tokens"])} | {("bfloat16", n) for n in tiny["lengths"]}
    f32 = parity[("float32", tiny["parity_tokens"])]
    assert f32["diff"] < 1e-5 and f32["argmax_same"]
    for n in tiny["lengths"]:  # bf16 on both sides, rounded in different places: about 1e-2 of the largest logit
        assert parity[("bfloat16", n)]["diff"] < 3e-2
    rows = [e["row"] for e in events if e["kind"] == "row"]
    assert [r[0] for r in rows] == list(tiny["lengths"]) and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_the_context_search_reaches_its_cap_on_a_cpu(cpu_run):
    events = cpu_run["results"]["parts"]["max_context"]["events"]
    rows = [e["row"] for e in events if e["kind"] == "row"]
    assert [(r[0], r[1]) for r in rows] == [(256, "fits"), (512, "fits"), (1024, "fits")]
    (result,) = [e for e in events if e["kind"] == "result"]
    assert result["largest"] == 1024 and "cap" in result["stop"]
    assert "**Largest context that fits: 1,024 tokens**" in cpu_run["report"]


def test_a_worker_past_its_budget_is_killed_and_keeps_its_rows(tmp_path):
    # a stand-in for the Python that runs the worker: writes one row to the events file, then hangs
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\nwhile [ "$1" != "--events" ]; do shift; done\n'
                    'echo \'{"kind": "row", "row": [1, 2]}\' >> "$2"\nexec sleep 60\n')
    fake.chmod(0o755)
    start = time.time()
    r = device.run_worker("kernels", size="tiny", budget=2, env=dict(os.environ), python=str(fake))
    assert time.time() - start < 20
    assert r.status == "cut short" and r.of("row") == [{"kind": "row", "row": [1, 2]}]
    assert r.cut == ["killed at its budget of 2 s (the rows above are what it finished)"]
    text = device.render({"kernels": r}, {}, size="tiny", command="c", started=start, total=480, cache=False,
                         env_error="probe failed")
    assert "Part 2 (kernels) cut short: killed at its budget of 2 s" in text and "| 2. kernels | cut short |" in text


def test_a_worker_that_exits_without_finishing_failed(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\nexit 3\n")
    fake.chmod(0o755)
    r = device.run_worker("torch", size="tiny", budget=30, env=dict(os.environ), python=str(fake))
    assert r.status == "failed" and "status 3" in r.error


def _fake_prefill(limit, error="RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB"):
    def make(model, length):
        def call():
            if length >= limit:
                raise RuntimeError(error)
            return None
        return call
    return make


def test_the_context_search_stops_at_an_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "kvjax_prefill", _fake_prefill(1024))
    events = tmp_path / "events.jsonl"
    device.worker_max_context(device.SIZES["tiny"], device.Clock(time.time() + 600), device.Emitter(events))
    got = [json.loads(x) for x in events.read_text().splitlines()]
    rows = [e["row"][:2] for e in got if e["kind"] == "row"]
    assert rows == [[256, "fits"], [512, "fits"], [1024, "out of memory"]]
    (result,) = [e for e in got if e["kind"] == "result"]
    assert result["largest"] == 512 and result["stop"].startswith("out of memory at 1024 tokens: RESOURCE_EXHAUSTED")
    # any other error is the part's failure, not a stop of the search
    monkeypatch.setattr(device, "kvjax_prefill", _fake_prefill(512, "INVALID_ARGUMENT: bad shapes"))
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        device.worker_max_context(device.SIZES["tiny"], device.Clock(time.time() + 600),
                                  device.Emitter(tmp_path / "other.jsonl"))


def test_the_context_search_stops_when_the_next_length_would_pass_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "kvjax_prefill", _fake_prefill(10**9))
    events = tmp_path / "events.jsonl"
    device.worker_max_context(device.SIZES["tiny"], device.Clock(time.time() - 1), device.Emitter(events))
    got = [json.loads(x) for x in events.read_text().splitlines()]
    assert [e["row"][:2] for e in got if e["kind"] == "row"] == [[256, "fits"]]  # the first length always runs
    (result,) = [e for e in got if e["kind"] == "result"]
    assert result["largest"] == 256 and "time budget" in result["stop"] and "not an out-of-memory" in result["stop"]
    assert [e["text"] for e in got if e["kind"] == "cut"] == ["the search stopped before 512 tokens (time budget)"]


@pytest.mark.parametrize("kind, gbps", [("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H200", 4800.0),
                                        ("TPU v4", 1200.0), ("TPU v5 lite", 819.0), ("TPU v5", 2765.0),
                                        ("TPU v5p", 2765.0), ("TPU v6 lite", 1640.0), ("Some New Accelerator", None)])
def test_peak_bandwidth_by_device_kind(kind, gbps):
    assert _timing.peak_bandwidth_gbps(types.SimpleNamespace(platform="gpu", device_kind=kind)) == gbps


def test_report_is_named_after_the_device():
    assert device.report_name({"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100-80gb-hbm3.md"
    assert device.report_name({"platform": "tpu", "device_kind": "TPU v5 lite"}) == "tpu-v5-lite.md"
    assert device.report_name({"platform": "cpu", "device_kind": "cpu"}) == "cpu.md"


def test_marker_files_leave_out_files_that_only_deselect_the_marker():
    files = [p.name for p in device.marker_files("gpu_only", REPO / "tests")]
    assert "test_kernels_decode_attention.py" in files and "test_ci_commands.py" not in files
