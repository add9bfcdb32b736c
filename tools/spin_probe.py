"""The spin-footprint probe: GEMM slowdown while K CTAs spin (K = 0, 8, 16, ...).

This is the curve that explains the negative result of the deployment this project
comes from (docs/design.md, 'The problem and the idea'): a spin-wait all-reduce
holds its CTAs while it waits for a peer, and every held CTA is one the GEMM it was
meant to hide under cannot use. The spinners (:mod:`radiance_ar.backends.kernels.spin_hold`) read a
pinned host flag that is never raised, and leave after a calibrated number of reads
that lasts as long as the GEMM alone: the model is an all-reduce that waits for its
peer throughout one GEMM. (Releasing them from the host only after the GEMM ends
measures something else: cuBLAS's persistent Hopper kernels then wait for the held SMs
until the spin bound expires; figures in docs/history.md.)
"""

from __future__ import annotations

import time
from typing import Callable

import torch

import metrics

CALIBRATION_ITERS = 2000
START_TIMEOUT_S = 5.0


def spin_iters_for(ms: float, ctas: int, flag: torch.Tensor, started: torch.Tensor) -> int:
    """Spin iterations that last about ``ms`` with ``ctas`` spinners (each iteration is a
    read of pinned host memory, so its cost depends on the PCIe round trip and on K)."""
    from radiance_ar.backends.kernels import spin_hold

    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        spin_hold.launch(flag, started[:ctas], CALIBRATION_ITERS)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    per_iter_ms = min(times) / CALIBRATION_ITERS
    return max(1, round(ms / per_iter_ms))


def gemm_with_spinners_ms(gemm: Callable[[int], None], ctas: int, spin_ms: float, reps: int,
                          warmup: int) -> list[float]:
    """Device times of ``gemm(i)`` while ``ctas`` CTAs spin for about ``spin_ms``."""
    from radiance_ar.backends.kernels import spin_hold

    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # never raised
    started = torch.zeros(max(ctas, 1), dtype=torch.int32, pin_memory=True)
    iters = spin_iters_for(spin_ms, ctas, flag, started) if ctas else 0
    side = torch.cuda.Stream()
    samples = []
    for i in range(warmup + reps):
        started.zero_()
        if ctas:
            with torch.cuda.stream(side):
                spin_hold.launch(flag, started[:ctas], iters)
            deadline = time.monotonic() + START_TIMEOUT_S
            while int((started[:ctas] != 0).sum()) < ctas:
                if time.monotonic() > deadline:
                    torch.cuda.synchronize()
                    raise RuntimeError(f"spin probe: only {int((started != 0).sum())} of {ctas} "
                                       f"spinning CTAs became resident within {START_TIMEOUT_S} s")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemm(i)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end))
    return samples


def spin_footprint(gemm: Callable[[int], None], ctas_list: list[int], reps: int,
                   warmup: int) -> list[dict]:
    """``[{"ctas": K, "t_gemm_ms": ..., "slowdown": ...}]``, slowdown vs K = 0."""
    base, spread = metrics.median_and_spread(gemm_with_spinners_ms(gemm, 0, 0.0, reps, warmup))
    rows = [{"ctas": 0, "t_gemm_ms": base, "spread_ms": spread, "slowdown": 1.0}]
    for ctas in [c for c in ctas_list if c > 0]:
        med, spread = metrics.median_and_spread(
            gemm_with_spinners_ms(gemm, ctas, base, reps, warmup))
        rows.append({"ctas": ctas, "t_gemm_ms": med, "spread_ms": spread,
                     "slowdown": metrics.contention(med, base)})
    return rows


def format_curve(rows: list[dict]) -> str:
    return "spin footprint (GEMM while K CTAs spin): " + ", ".join(
        f"K={r['ctas']}: {r['t_gemm_ms']:.3f} ms ({r['slowdown']:.2f}x)" for r in rows)
