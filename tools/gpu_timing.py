"""GPU timing primitives shared by the measurement modes: events, L2 rotation, contention.

Every time is a median of device-event times over ``reps`` samples after ``warmup``
calls, a sample being the per-call time of a few calls back to back (:func:`event_times`);
inputs rotate among enough copies that the set exceeds the L2 several times (the
H200's L2 is 60 MB), so no call reads what the previous one left in cache.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Callable

import torch

import metrics
from radiance_ar.harness.host import freeze_heap

ROTATE_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
#: contention is a ratio of two medians a few percent apart: fewer repeats leave its
#: spread as large as the effect it is meant to show
CONTENTION_MIN_REPS = 20


def copies_for(t: torch.Tensor) -> int:
    """How many copies of ``t`` rotate beyond the L2."""
    return max(2, math.ceil(ROTATE_BYTES / max(1, t.numel() * t.element_size())))


#: calls timed back to back per sample, after one untimed call that absorbs the start
#: (:func:`event_times`)
CALLS_PER_SAMPLE = 4
#: the device lead before a sample, in units of one call's host time (warm-up median)
LEAD_CALLS = 1.5


@functools.cache
def _sleep_cycles_per_ms(index: int) -> float:
    """GPU clock cycles per ms of ``torch.cuda._sleep`` on device ``index`` (measured once)."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def device_lead(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` without touching memory, so that the
    host enqueues what follows while the device is still occupied (host ahead)."""
    if ms > 0:
        cycles = _sleep_cycles_per_ms(torch.cuda.current_device()) * ms
        torch.cuda._sleep(int(cycles))


def event_times(fn: Callable[[int], None], reps: int, warmup: int,
                before: Callable[[], None] | None = None,
                host_ms: list[float] | None = None,
                calls: int = CALLS_PER_SAMPLE) -> list[float]:
    """Device time in ms of one ``fn(i)`` in a stream of calls, one sample per ``reps``.

    A sample is ``calls + 1`` calls back to back with an event after each; its time is
    from the end of the first call to the end of the last, divided by ``calls``: each
    call then runs behind another, as a layer's op does in a model, and each interval
    is max(device time, host time) of one call, so a call whose host enqueue outlasts
    its device time shows up. The first call absorbs the start: before it the stream
    sleeps :data:`LEAD_CALLS` times one call's host time (warm-up median), so the host
    is ahead from the start; that head start would hide part of a host-bound call's
    time, so a sample is the larger of the per-call device time and the per-call host
    time of the timed calls (the rate a long stream of them runs at). ``before()`` (e.g.
    a barrier across ranks) runs untimed ahead of every sample. ``host_ms``: also append
    each sample's host time per timed call (the Python calls that enqueue it). The heap
    is frozen first, as a serving process freezes it after warm-up (:mod:`radiance_ar.harness.host`)."""
    freeze_heap()
    warm_host = []
    for i in range(warmup):
        t0 = time.perf_counter()
        fn(i)
        warm_host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()  # each warm-up call's host time alone, queue empty
    lead = LEAD_CALLS * statistics.median(warm_host) if warm_host else 0.0
    samples = []
    for rep in range(reps):
        if before is not None:
            before()
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
        device_lead(lead)
        fn(rep * (calls + 1))
        ends[0].record()
        t0 = time.perf_counter()
        for k in range(1, calls + 1):
            fn(rep * (calls + 1) + k)
            ends[k].record()
        host = (time.perf_counter() - t0) * 1e3 / calls
        if host_ms is not None:
            host_ms.append(host)
        ends[-1].synchronize()
        # The host had a head start (the lead and the first call's device time), so
        # where it is the slower side the events alone would understate a call: a stream
        # of calls runs at the slower of the two rates.
        samples.append(max(ends[0].elapsed_time(ends[-1]) / calls, host))
    return samples


#: calls captured into one graph per :func:`replayed_times` sample
REPLAYED_CALLS = 8


def replayed_times(fn: Callable[[int], None], reps: int,
                   calls: int = REPLAYED_CALLS) -> list[float]:
    """Device time in ms of one ``fn(i)`` with no host cost: ``calls`` calls (i = 0 ..
    calls - 1, inputs rotated by the caller) captured once into a CUDA graph on a side
    stream, the graph replayed ``reps`` times, each replay's time over ``calls`` a sample.
    For kernels shorter than their launch (a Triton launch costs the host 25-50 us on an
    H200 host, more than the quantizer's 34 us): :func:`event_times` times the host there,
    as a stream of eager calls would run. ``fn`` must not synchronize or allocate outside
    the graph's pool; a first round runs uncaptured (compiles, warms)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()  # the first replay uploads the graph
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return samples


def concurrent_times(main_fn: Callable[[int], None], side_fn: Callable[[int], None],
                     side_calls: int, reps: int, warmup: int,
                     phases_ms: list[float] | None = None,
                     before: Callable[[], None] | None = None) -> list[float]:
    """Device time of ``main_fn(i)`` while ``side_calls`` calls of ``side_fn`` run on
    another stream (sized by the caller to outlast it), one sample per repeat.

    Both streams are held by one event until the host has enqueued both (a device sleep
    of :data:`LEAD_CALLS` times the longest host time of a repeat so far), so where
    ``main_fn`` lands in the side work does not depend on how fast the host enqueues it:
    repeat k starts ``main_fn`` ``phases_ms[k % len(phases_ms)]`` after the side work (a
    device sleep; default 0). ``before()`` (a barrier across ranks, where ``side_fn`` is a
    collective of processes) runs untimed ahead of every repeat, warm-up included: each
    rank's repeats end with a synchronize, so without it the ranks' repeats drift apart and
    a rank's side calls wait for a peer that is still in its previous repeat."""
    side, gate = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()
    go = torch.cuda.Event()
    phases = phases_ms or [0.0]
    lead = 0.0
    samples = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        gate.wait_stream(main)
        side.wait_stream(main)
        with torch.cuda.stream(gate):
            device_lead(lead)
            go.record(gate)
        side.wait_event(go)
        with torch.cuda.stream(side):
            for j in range(side_calls):
                side_fn(j)
        main.wait_event(go)
        device_lead(phases[(i - warmup) % len(phases)] if i >= warmup else 0.0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        main_fn(i)
        end.record(main)
        main.wait_stream(side)
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        lead = max(lead, LEAD_CALLS * host_ms)  # the host enqueues all before the gate opens
        if i >= warmup:
            samples.append(start.elapsed_time(end))
    return samples


def contention_times(gemm: Callable[[int], None], ar: Callable[[int], None], t_gemm: float,
                     t_ar: float, reps: int, warmup: int,
                     before: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """Device times of ``gemm`` alone and while ``ar`` runs back to back beside it, each
    over max(reps, CONTENTION_MIN_REPS) repeats whose GEMM starts at evenly spread points
    of one AR call (phase k/reps of ``t_ar``): an AR's parts differ in what they take from
    a GEMM (the copies little, its reduce kernel more), so one fixed start point would
    measure one part only, and which part would depend on the host's enqueue speed. The
    GEMM alone runs the same way (the gate, the sleep, one call): a GEMM after an idle
    gap runs at a higher clock than GEMMs back to back (seen on the H200: "contention"
    0.87-0.96x against the back-to-back median), so only like against like is a ratio
    of the AR's effect. ``t_gemm``/``t_ar`` (medians, ms) size the AR calls to outlast
    every phase; ``before``: as :func:`concurrent_times`'."""
    reps = max(reps, CONTENTION_MIN_REPS)
    side_calls = max(2, math.ceil((t_ar + t_gemm) / t_ar) + 1)
    phases = [t_ar * k / reps for k in range(reps)]
    alone = concurrent_times(gemm, ar, 0, reps, warmup, phases, before)
    return alone, concurrent_times(gemm, ar, side_calls, reps, warmup, phases, before)


def contention_record(samples: tuple[list[float], list[float]]) -> dict:
    """The record's contention keys from :func:`contention_times`'s (alone, beside)
    samples, one per phase: ``contention`` is the ratio of their MEANS (the expected
    slowdown of a GEMM overlapping a random point of the AR; a median would drop the
    phases that meet the reduce kernel), ``contention_spread`` half the IQR of the
    GEMM beside the AR over the GEMM alone, ``contention_max`` the worst phase's ratio."""
    alone, beside = samples
    t_alone, t_beside = statistics.fmean(alone), statistics.fmean(beside)
    _, spread = metrics.median_and_spread(beside)
    return {"t_gemm_gated_ms": t_alone, "t_gemm_concurrent_ms": t_beside,
            "t_gemm_concurrent_spread_ms": spread,
            "contention": metrics.contention(t_beside, t_alone),
            "contention_spread": metrics.contention_spread(spread, t_alone),
            "contention_max": max(b / a for a, b in zip(alone, beside)),
            "contention_reps": len(beside)}


def median_ms(fn: Callable[[int], None], reps: int, warmup: int) -> float:
    """The median device time of ``fn`` in ms (:func:`event_times`)."""
    return metrics.median_and_spread(event_times(fn, reps, warmup))[0]


def device_and_host_ms(fn: Callable[[int], None], reps: int, warmup: int,
                       before: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """(device median, its spread, host median) of ``fn`` in ms (see :func:`event_times`)."""
    host: list[float] = []
    med, spread = metrics.median_and_spread(event_times(fn, reps, warmup, before, host))
    return med, spread, statistics.median(host)
