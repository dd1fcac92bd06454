"""Timing a call as the benchmarks do: untimed warm-up calls first, then one
``time.perf_counter`` sample per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["median_s", "samples"]


def samples(fn: Callable[[], object], count: int, *, warmup: int = 1) -> list[float]:
    """Seconds of each of ``count`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_s(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``rounds`` calls, after one untimed warm-up call."""
    return statistics.median(samples(fn, rounds))
