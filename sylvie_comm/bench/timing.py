"""Timing and memory measurement shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo``; else ``platform.processor()`` (which runs ``uname -p`` in a
    process of its own on Linux, so it is asked only where the file cannot tell); None when neither knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None


def seconds_per_call(fn: Callable[[], Any], min_time: float = 0.2, max_calls: int = 50) -> float:
    """Median wall time of ``fn`` over repeated calls after one warm-up call.

    Calls repeat until ``min_time`` seconds have passed (at least 3, at most ``max_calls``).
    """
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Kineto, the profiler's backend, logs a "profiler_start" and a "profiler_stop" line to stderr each time a
# trace starts and stops. Those lines have a severity of their own, USDT (5), above ERROR (4), so the default
# threshold, which hides kineto's info, warning and stage lines, lets them through: two lines per measurement.
# Kineto reads KINETO_LOG_LEVEL once, when the profiler first starts in a process; 6 is above every severity
# and silences kineto's log (its errors too) for that process. The memory events read here are recorded by
# torch's allocator hooks, not logged by kineto.
_KINETO_QUIET_LEVEL = "6"


def _quiet_kineto() -> None:
    """Raise kineto's log threshold above its trace markers, unless the user chose a level."""
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET_LEVEL)


def peak_torch_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of CPU tensor memory allocated during one call of ``fn`` (its outputs included)."""
    _quiet_kineto()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    current = peak = 0
    for e in events:
        current += e.cpu_memory_usage
        peak = max(peak, current)
    return peak


def peak_numpy_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes NumPy allocated during one call of ``fn`` (NumPy reports to tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


class threads:
    """Context manager running torch ops with ``n`` intra-op threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.before = torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)
