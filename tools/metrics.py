"""The measurement definitions of docs/design.md ('Measurement'), as pure functions (tested on CPU).

    speedup    = T_serial / T_ovl(b, S)    T_serial: GEMM then stock's AR (one GPU per
                                           rank) or b's own unsliced AR (ranks share a GPU)
    hidden     = (T_gemm + T_ar - T_ovl) / min(T_gemm, T_ar)   1 perfect, 0 none, < 0 worse
    contention = T_gemm while b's AR runs concurrently / T_gemm alone
    bound      = max(T_gemm + T_ar f_last, T_ar + T_gemm f_first)  the pipeline's ideal
                 (f: the first / last slice's share of the rows; 1/S each when uniform);
                 of a prefill: its off arm less, per RowParallel call, T_gemm + T_ar - bound
    efficiency = bound / T_ovl                                  1: the op reaches its ideal
    speedup bound = T_serial / bound                            the speedup at efficiency 1
    slice overhead = (T_ar of S back-to-back slice ARs - T_ar unsliced) / S
                     (None where the host enqueued those calls slower than they ran)
    link efficiency = bus GB/s / link GB/s                      the AR's share of its raw link

Every T is a median of the same run, in ms; contention alone is a ratio of MEANS over
its GEMM starts (tools/gpu_timing.contention_record: a median would drop the starts that
meet the AR's reduce). Record keys: ``bound_ms``, ``efficiency``,
``speedup_bound``, ``contention`` and ``contention_spread`` (half its IQR over T_gemm
alone, >= 20 repeats), ``t_ar_sliced_ms`` and ``slice_overhead_us`` (None where S = 1),
``slice_overhead_host_bound``, ``bus_gbs``, ``link_gbs`` (tools/link.py; None on CPU
worlds) and ``link_efficiency``.
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

import torch


def median_and_spread(samples: Sequence[float]) -> tuple[float, float]:
    """Median and half the inter-quartile range of ``samples`` (at least one)."""
    if not samples:
        raise ValueError("median_and_spread: no samples")
    ordered = sorted(samples)
    if len(ordered) < 4:
        return statistics.median(ordered), (ordered[-1] - ordered[0]) / 2
    q1, _, q3 = statistics.quantiles(ordered, n=4)
    return statistics.median(ordered), (q3 - q1) / 2


def tflops(m: int, n: int, k: int, ms: float) -> float:
    """TFLOP/s of an M x N x K GEMM taking ``ms``: 2MNK / t."""
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def speedup(t_serial_stock: float, t_ovl: float) -> float:
    return t_serial_stock / t_ovl


def hidden_fraction(t_gemm: float, t_ar: float, t_ovl: float) -> float:
    return (t_gemm + t_ar - t_ovl) / min(t_gemm, t_ar)


def contention(t_gemm_concurrent: float, t_gemm_alone: float) -> float:
    return t_gemm_concurrent / t_gemm_alone


def contention_spread(t_gemm_concurrent_spread: float, t_gemm_alone: float) -> float:
    """The spread of :func:`contention`: half the IQR of the concurrent GEMM time, in
    units of T_gemm alone (so ``contention +- contention_spread`` reads as a ratio)."""
    return t_gemm_concurrent_spread / t_gemm_alone


def bound_ms(t_gemm: float, t_ar: float, bounds: Sequence[int]) -> float:
    """The pipeline's ideal time for the row ``bounds`` the op ran (``[0, ..., M]``):
    every GEMM slice then the last AR slice, or the first GEMM slice then every AR slice,
    whichever is longer (the pipeline is no faster than its longer lane plus the slice of
    the other that cannot overlap anything), each slice costing its share of the rows."""
    if len(bounds) < 2 or bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bound_ms: bounds must rise from 0 in at least one slice, got "
                         f"{list(bounds)!r}")
    rows = bounds[-1]
    first, last = bounds[1] / rows, (rows - bounds[-2]) / rows
    return max(t_gemm + t_ar * last, t_ar + t_gemm * first)


def stack_bound_ms(t_off: float, calls: Sequence[tuple[int, float, float, float,
                                                      Sequence[int]]]) -> float:
    """A whole stack's time at efficiency 1 (a prefill's ``bound_ms``): ``t_off``, the
    stack with every RowParallel call serial, less what each call's pipeline could hide.
    Each entry of ``calls`` is ``(count, t_gemm, t_ar_off, t_ar_on, bounds)``: ``count``
    calls whose GEMM alone takes ``t_gemm``, whose serial arm's all-reduce ``t_ar_off``, the
    sliced arm's backend's unsliced all-reduce ``t_ar_on`` (the same backend in the emulated
    world), cut at ``bounds``; each saves ``t_gemm + t_ar_off - bound_ms(t_gemm, t_ar_on,
    bounds)``."""
    return t_off - sum(count * (t_gemm + t_ar_off - bound_ms(t_gemm, t_ar_on, bounds))
                       for count, t_gemm, t_ar_off, t_ar_on, bounds in calls)


def efficiency(bound: float, t_ovl: float) -> float:
    """How close the op comes to its pipeline's ideal: 1 reaches it, 0.5 takes twice as long."""
    return bound / t_ovl


def speedup_bound(t_serial: float, bound: float) -> float:
    """The speedup the op would reach at efficiency 1 with the row bounds it ran: the most
    those slices can give in this world. Where the AR is several times the GEMM it is
    close to 1 whatever the backend (at most 1 + T_gemm (1 - f_first) / T_ar, f_first the
    first slice's share of the rows), so a target above it cannot be met with them."""
    return t_serial / bound


def slice_overhead_us(t_ar_sliced_ms: float, t_ar_ms: float, slices: int) -> float:
    """What one extra AR call costs, in us: the AR of the whole tensor as ``slices`` calls
    back to back, minus the one unsliced call, per slice (fixed costs: launches, flag
    round trips, DMA setup; negative only within timing noise)."""
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
        raise ValueError(f"slice_overhead_us: slices must be an int >= 1, got {slices!r}")
    return (t_ar_sliced_ms - t_ar_ms) / slices * 1e3


#: a timed median whose host median reaches this share of it is the host's: each sample is
#: max(device, host) of one stream of calls (tools/gpu_timing.event_times), so the two
#: medians meet only where the host is the slower side. The sliced AR that showed it
#: (sdma_wht6, W = 2, S = 4, H100, tools/results/2026-12-05-h100-urgent-streams-ab/
#: ab_lane_w2_a.csv) had them equal, eager calls costing 334 us of host each.
HOST_BOUND_SHARE = 0.99


def host_bound(t_ms: float, t_host_ms: float | None) -> bool:
    """Whether a timed median ``t_ms`` is the host's time (its host median ``t_host_ms``
    reaches it; None: no host time, as on CPU worlds)."""
    return t_host_ms is not None and t_host_ms >= HOST_BOUND_SHARE * t_ms


def link_efficiency(bus_gbs: float, link_gbs: float) -> float:
    """The AR's bus bandwidth as a share of the raw link's, measured in the same run."""
    if not link_gbs > 0:
        raise ValueError(f"link_efficiency: link_gbs must be > 0, got {link_gbs!r}")
    return bus_gbs / link_gbs


def bus_bandwidth_gbs(wire_bytes: int, t_ar_ms: float) -> float:
    """Bytes each rank puts on the wire per second, in GB/s (1e9)."""
    return wire_bytes / (t_ar_ms * 1e-3) / 1e9


def derived(t: Mapping[str, float | None], bounds: Sequence[int], wire_bytes: int,
            link_gbs: float | None = None) -> dict:
    """The figures of one case from its medians ``t`` (ms; keys gemm, ar, serial, ovl and
    optionally ar_sliced, None where not measured) and the row bounds the op ran.

    Keys: slices_run (S after clamping to the rows), speedup, hidden, bound_ms, efficiency,
    speedup_bound, t_ar_sliced_ms, slice_overhead_us, slice_overhead_host_bound,
    bus_gbs, link_gbs, link_efficiency; a figure whose input is missing is None. Where
    the sliced AR's time is its host's (``ar_sliced_host``: :func:`host_bound`), the
    slice overhead would be Python's enqueue time, not the device's: None, and
    ``slice_overhead_host_bound`` says so."""
    slices = len(bounds) - 1
    bound = bound_ms(t["gemm"], t["ar"], bounds)
    bus = bus_bandwidth_gbs(wire_bytes, t["ar"])
    sliced = t.get("ar_sliced")
    by_host = sliced is not None and host_bound(sliced, t.get("ar_sliced_host"))
    return {
        "slices_run": slices,
        "speedup": speedup(t["serial"], t["ovl"]),
        "hidden": hidden_fraction(t["gemm"], t["ar"], t["ovl"]),
        "bound_ms": bound,
        "efficiency": efficiency(bound, t["ovl"]),
        "speedup_bound": speedup_bound(t["serial"], bound),
        "t_ar_sliced_ms": sliced,
        "slice_overhead_us": (None if sliced is None or by_host
                              else slice_overhead_us(sliced, t["ar"], slices)),
        "slice_overhead_host_bound": by_host,
        "bus_gbs": bus,
        "link_gbs": link_gbs,
        "link_efficiency": None if link_gbs is None else link_efficiency(bus, link_gbs),
    }


def errors(result: torch.Tensor, reference: torch.Tensor,
           work: torch.Tensor | None = None) -> tuple[float, float]:
    """(relative RMS error, max abs error) of ``result`` against a float64 ``reference``.

    ``work``: a float64 tensor of the same shape to form the difference in, so that a soak
    allocates nothing of the result's size per call (its memory check watches the caching
    allocator)."""
    if result.shape != reference.shape:
        raise ValueError(f"errors: result {tuple(result.shape)} vs reference {tuple(reference.shape)}")
    if work is not None and (work.shape != reference.shape or work.dtype != torch.float64
                             or work.data_ptr() == reference.data_ptr()):
        raise ValueError(f"errors: work must be a float64 tensor of shape "
                         f"{tuple(reference.shape)} apart from the reference")
    if work is None:
        diff = result.double() - reference.double()
    else:
        diff = work.copy_(result).sub_(reference)
    ref_rms = torch.linalg.vector_norm(reference.double()).item() / math.sqrt(max(reference.numel(), 1))
    rms = torch.linalg.vector_norm(diff).item() / math.sqrt(max(diff.numel(), 1))
    rel = rms / ref_rms if ref_rms > 0 else (0.0 if rms == 0 else math.inf)
    return rel, (diff.abs() if work is None else diff.abs_()).max().item()
