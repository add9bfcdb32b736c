"""The measurement definitions of DESIGN 4, as pure functions (tested on CPU).

    speedup    = T_serial(stock) / T_ovl(b, S)
    hidden     = (T_gemm + T_ar - T_ovl) / min(T_gemm, T_ar)   1 perfect, 0 none, < 0 worse
    contention = T_gemm while b's AR runs concurrently / T_gemm alone
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

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


def speedup(t_serial_stock: float, t_ovl: float) -> float:
    return t_serial_stock / t_ovl


def hidden_fraction(t_gemm: float, t_ar: float, t_ovl: float) -> float:
    return (t_gemm + t_ar - t_ovl) / min(t_gemm, t_ar)


def contention(t_gemm_concurrent: float, t_gemm_alone: float) -> float:
    return t_gemm_concurrent / t_gemm_alone


def bus_bandwidth_gbs(wire_bytes: int, t_ar_ms: float) -> float:
    """Bytes each rank puts on the wire per second, in GB/s (1e9)."""
    return wire_bytes / (t_ar_ms * 1e-3) / 1e9


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
