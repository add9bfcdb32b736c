"""GPU timing primitives shared by the measurement modes: events, L2 rotation, contention.

Every time is a median of device-event times over ``reps`` calls after ``warmup``;
inputs rotate among enough copies that the set exceeds the L2 several times (the
H200's L2 is 60 MB), so no call reads what the previous one left in cache.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

import metrics

ROTATE_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
#: contention is a ratio of two medians a few percent apart: fewer repeats leave its
#: spread as large as the effect it is meant to show
CONTENTION_MIN_REPS = 20


def copies_for(t: torch.Tensor) -> int:
    """How many copies of ``t`` rotate beyond the L2."""
    return max(2, math.ceil(ROTATE_BYTES / max(1, t.numel() * t.element_size())))


def event_times(fn: Callable[[int], None], reps: int, warmup: int,
                before: Callable[[], None] | None = None,
                host_ms: list[float] | None = None) -> list[float]:
    """Device time in ms of ``fn(i)`` for i = 0..reps-1, each call synchronized alone;
    ``before()`` (e.g. a barrier across ranks) runs untimed ahead of every timed call.
    ``host_ms``: also append each call's host time (the Python call that enqueues it):
    where it reaches the device time, the device waited for the host."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    samples = []
    for i in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn(i)
        if host_ms is not None:
            host_ms.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def concurrent_times(main_fn: Callable[[int], None], side_fn: Callable[[int], None],
                     side_calls: int, reps: int, warmup: int) -> list[float]:
    """Device time of ``main_fn(i)`` while ``side_calls`` calls of ``side_fn`` run on
    another stream, started together; the side work is sized to outlast ``main_fn``."""
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    samples = []
    for i in range(warmup + reps):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for j in range(side_calls):
                side_fn(j)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        main_fn(i)
        end.record(main)
        main.wait_stream(side)
        torch.cuda.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end))
    return samples


def contention_times(gemm: Callable[[int], None], ar: Callable[[int], None], t_gemm: float,
                     t_ar: float, reps: int, warmup: int) -> list[float]:
    """Device times of ``gemm`` while ``ar`` runs back to back beside it, over
    max(reps, CONTENTION_MIN_REPS) repeats; ``t_gemm``/``t_ar`` (medians alone, ms) size
    the AR calls so that they outlast the GEMM."""
    side_calls = max(2, math.ceil(t_gemm / t_ar) + 2)
    return concurrent_times(gemm, ar, side_calls, max(reps, CONTENTION_MIN_REPS), warmup)


def contention_record(samples: list[float], t_gemm: float) -> dict:
    """The record's contention keys from :func:`contention_times`'s samples."""
    med, spread = metrics.median_and_spread(samples)
    return {"t_gemm_concurrent_ms": med, "t_gemm_concurrent_spread_ms": spread,
            "contention": metrics.contention(med, t_gemm),
            "contention_spread": metrics.contention_spread(spread, t_gemm),
            "contention_reps": len(samples)}


def median_ms(samples: list[float]) -> tuple[float, float]:
    return metrics.median_and_spread(samples)


def device_and_host_ms(fn: Callable[[int], None], reps: int, warmup: int,
                       before: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """(device median, its spread, host median) of ``fn`` in ms (see :func:`event_times`)."""
    host: list[float] = []
    med, spread = metrics.median_and_spread(event_times(fn, reps, warmup, before, host))
    return med, spread, statistics.median(host)
