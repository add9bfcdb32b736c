"""The spin-footprint probe: GEMM slowdown while K CTAs spin on a flag (K = 0, 8, ...).

This is the curve that explains the seed's negative result: a spin-wait all-reduce
holds its CTAs while it waits for a peer, and every held CTA is one the GEMM it was
meant to hide under cannot use. The spinners (:mod:`backends.kernels.spin_hold`) read a
pinned host flag in a loop; the host releases them once the timed GEMM has finished.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

import metrics

# Each spin iteration is one read of host memory (~1 us over PCIe): 2e6 bounds a spinner
# whose host died to a few seconds.
MAX_SPIN_ITERS = 2_000_000
START_TIMEOUT_S = 5.0


def gemm_with_spinners_ms(gemm: Callable[[int], None], ctas: int, reps: int, warmup: int) -> list[float]:
    """Device times of ``gemm(i)`` while ``ctas`` spinning CTAs hold their SMs."""
    from backends.kernels import spin_hold

    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    started = torch.zeros(max(ctas, 1), dtype=torch.int32, pin_memory=True)
    side = torch.cuda.Stream()
    samples = []
    for i in range(warmup + reps):
        flag.zero_()
        started.zero_()
        if ctas:
            with torch.cuda.stream(side):
                spin_hold.launch(flag, started[:ctas], MAX_SPIN_ITERS)
            deadline = time.monotonic() + START_TIMEOUT_S
            while int((started[:ctas] != 0).sum()) < ctas:
                if time.monotonic() > deadline:
                    flag.fill_(1)
                    torch.cuda.synchronize()
                    raise RuntimeError(f"spin probe: only {int((started != 0).sum())} of {ctas} "
                                       f"spinning CTAs became resident within {START_TIMEOUT_S} s")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemm(i)
        end.record()
        end.synchronize()
        flag.fill_(1)
        torch.cuda.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end))
    return samples


def spin_footprint(gemm: Callable[[int], None], ctas_list: list[int], reps: int,
                   warmup: int) -> list[dict]:
    """``[{"ctas": K, "t_gemm_ms": ..., "slowdown": ...}]``, slowdown vs K = 0."""
    rows = []
    base = None
    for ctas in [0] + [c for c in ctas_list if c > 0]:
        med, spread = metrics.median_and_spread(gemm_with_spinners_ms(gemm, ctas, reps, warmup))
        base = med if ctas == 0 else base
        rows.append({"ctas": ctas, "t_gemm_ms": med, "spread_ms": spread,
                     "slowdown": metrics.contention(med, base)})
    return rows


def format_curve(rows: list[dict]) -> str:
    return "spin footprint (GEMM while K CTAs spin): " + ", ".join(
        f"K={r['ctas']}: {r['t_gemm_ms']:.3f} ms ({r['slowdown']:.2f}x)" for r in rows)
