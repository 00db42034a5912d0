"""Timing a step, reading FLOPs and peak memory from JAX, and MFU against the GPU's peak."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

# Dense bf16 tensor-core peaks (no sparsity), TFLOPS, by a substring of the device name
# JAX reports (`device_kind`); the first match wins. From NVIDIA's data sheets.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
)


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (None: not in `PEAK_BF16_TFLOPS`)."""
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_kind:
            return value
    return None


def mfu(flops: float | None, seconds: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation: `flops` per `seconds` over `peak` TFLOPS (None if unknown)."""
    if not flops or not seconds or not peak:
        return None
    return flops / seconds / (peak * 1e12)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def median_step(run: Callable[[int], float], warmup: int, steps: int, deadline: float):
    """Runs `run(i)` (returns the loss) `warmup` times, then times up to `steps` runs
    (fewer if `deadline` comes first); returns (median seconds, times, losses)."""
    losses, times = [], []
    for i in range(warmup):
        losses.append(run(i))
    for i in range(warmup, warmup + steps):
        if times and time.monotonic() > deadline:
            break
        start = time.perf_counter()
        losses.append(run(i))
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, losses


def time_us(fn, repeat: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def flops_of(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops else None


def jax_peak_bytes(device) -> int | None:
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use")
