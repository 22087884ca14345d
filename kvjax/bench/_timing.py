"""Timing, device description and table helpers shared by the bench subcommands."""

from __future__ import annotations

import datetime
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

# Peak HBM bandwidth in GB/s by device_kind substring (vendor spec sheets), checked in order.
PEAK_BANDWIDTH_GBPS = (
    ("TPU v5 lite", 819.0), ("TPU v5e", 819.0), ("TPU v5p", 2765.0), ("TPU v5", 2765.0),
    ("TPU v6 lite", 1640.0), ("TPU v6e", 1640.0), ("TPU7x", 7370.0), ("TPU v7", 7370.0),
    ("TPU v4", 1200.0), ("TPU v3", 900.0),
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0), ("L4", 300.0), ("A10G", 600.0),
)


def peak_bandwidth_gbps(device: Any | None = None) -> float | None:
    """Spec-sheet HBM bandwidth of the device, or None (CPU, unknown accelerator)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    kind = getattr(device, "device_kind", "")
    for key, value in PEAK_BANDWIDTH_GBPS:
        if key.lower() in kind.lower():
            return value
    return None


def describe_device() -> str:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    if device.platform == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}, {jax.device_count()} JAX CPU device(s))"
    return f"{kind} x{jax.device_count()} ({device.platform})"


def header_lines() -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [f"- device: {describe_device()}", f"- jax {jax.__version__}, python {platform.python_version()}",
            f"- recorded: {now}"]


def median_seconds(fn: Callable[..., Any], args: Sequence[Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` runs, after ``warmup`` runs (compile)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return x if isinstance(x, str) else f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def emit(report: str, out: pathlib.Path | None) -> None:
    """Prints a bench's markdown report and, given `out`, writes it there too (folders created)."""
    print(report)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
