"""Which way an ``mxfp4_w4a8`` call multiplies, and the per-weight column plan it needs.

The cuBLAS fp8 route: where every output channel of the weight is exact in e4m3 after a
per-channel power-of-two shift (:func:`radiance_ar.overlap.kernels.mxfp4_fp8_gemm.plan_columns`:
its ``top`` and ``col_scale``), a call widens the weight to e4m3 once (N x K bytes into a
scratch buffer, :mod:`radiance_ar.overlap.kernels.mxfp4_widen_fp8`) and runs torch's fp8
GEMM with rowwise scales: the per-token activation scale and ``col_scale`` per channel,
both applied in the GEMM's epilogue. The products are exact and ``col_scale`` is a power
of two, so the result is the fp32 sum of the exact products times x_scale, rounded to
bf16, as on the Triton routes (up to summation order and the fp8 GEMM's accumulation,
fast accumulation off). It pays the widening every call (0.096 ms at 5120 x 4352 on the
H200, tools/results/2026-12-04-h200-mxfp4-widen/, beside a 0.27 ms fp8 GEMM at 8192 rows,
bench_mxfp4.json of -mxfp4-end-to-end/, trimmed: git show 0f4a3bd:<that path>), so it is for
prefill-sized calls (:func:`cublas_min_rows`); the widened weight is scratch, not kept (a
kept copy would double an MXFP4 weight's memory).

Otherwise the packed weight goes to a Triton kernel (the bf16-widening
``mxfp4_w4a8`` for a weight that does not fit, with a warning naming the reason once per
weight). How often a weight does not fit: in synthetic weights (Gaussian, heavy-tailed,
super weights up to 10^4x, log-normal input channels) no channel did
(tools/results/2026-12-04-cpu-mxfp4-scale-spread/); no real checkpoint was measured.

The plan reads the whole weight and synchronizes, so it is made once per weight and
cached by the scale tensor, remade when either tensor is written in place through
itself (their version counters) or replaced. A write through ``.data`` (as weight loaders
do: ``param.data.copy_(...)``) moves no version counter: whoever reloads weights that way
calls :func:`forget_plans`. Under CUDA-graph capture an unplanned weight is refused: one
eager call per weight first (vLLM's warm-up is one). A weight rewritten in place gets
its new plan written into the old plan's tensors, so that a graph captured before (which
holds their addresses and the weight's) computes with the new plan; the route a graph
captured stays its own, so a rewrite that makes a fitting weight not fit needs the
graphs of that weight dropped (a case this code does not detect at replay).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fp8_kernel
from radiance_ar.streams import capturing

#: The cuBLAS fp8 route pays the widening, N x K bytes written and read again; below
#: these many rows the fp8 Triton kernel, which reads the 4-bit weight directly, wins.
#: From the H200 sweep of 2026-12-04 (tools/results/2026-12-04-h200-mxfp4-end-to-end/
#: sweep.json, trimmed: git show 0f4a3bd:<that path>; widening included): at K = 2048
#: (o_proj) and 4096 rows the Triton kernel was faster for N = 4096 and 5120 (0.127 and
#: 0.134 against 0.217 and 0.169 ms) and slower for N = 8192 (0.212 against 0.193), at 16384
#: rows slower for all; at K = 6400 and 7168 (down_proj) the cuBLAS route was faster already
#: at 2048 rows (0.163-0.312 against 0.173-0.339 ms). Between the measured row counts, and
#: for K between 2048 and 6400 (the bench's 4352 included), the threshold is an estimate.
#: (largest K, fewest rows), in order of K; the last row holds for every K
CUBLAS_MIN_ROWS = ((2048, 8192), (2 ** 31, 2048))


def cublas_min_rows(k: int) -> int:
    """The fewest rows for which a call of inner dimension ``k`` takes the cuBLAS route."""
    return next(rows for up_to, rows in CUBLAS_MIN_ROWS if k <= up_to)

#: column plans by scale tensor: (the versions and codes they were made from, the plan)
_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _stamp(w: torch.Tensor, w_scale: torch.Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), w._version, w_scale.data_ptr(), w_scale._version)


def forget_plans() -> None:
    """Mark every cached column plan stale (after weights were rewritten through ``.data``,
    which the version counters do not see): each weight is planned again at its next
    eager call, into the old plan's tensors where the shapes allow (dropping them would
    free what a captured graph of the weight reads)."""
    for key, (_, plan) in list(_PLANS.items()):
        _PLANS[key] = (None, plan)


def cached_plan(w: torch.Tensor, w_scale: torch.Tensor) -> fp8_kernel.ColumnPlan:
    """The column plan of this weight, made at its first call (or after a rewrite)."""
    stamp = _stamp(w, w_scale)
    hit = _PLANS.get(w_scale)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    if capturing(w.device):
        raise RuntimeError("producer mxfp4_w4a8: a weight's column plan is made at its first "
                           "call, which synchronizes: run one eager call with the weight "
                           "before capturing a CUDA graph (or after rewriting the weight)")
    plan = fp8_kernel.plan_columns(w, w_scale)
    if hit is not None and hit[1].top.shape == plan.top.shape:
        # Rewritten in place: the new plan goes into the old plan's tensors, whose
        # addresses a captured CUDA graph of this weight holds (module doc).
        hit[1].top.copy_(plan.top)
        hit[1].col_scale.copy_(plan.col_scale)
        plan = dataclasses.replace(hit[1], reason=plan.reason)
    if not plan.fits:
        warnings.warn(f"mxfp4_w4a8: this weight is not exact in e4m3 ({plan.reason}): it runs "
                      "on the bf16-widening Triton kernel, not on fp8 tensor cores",
                      stacklevel=3)
    _PLANS[w_scale] = (stamp, plan)
    return plan


@functools.lru_cache(maxsize=None)  # asked by every MXFP4 op call's prepare
def _nvidia_major(device: torch.device) -> int | None:
    """The compute capability's major number of an NVIDIA ``device``, else None."""
    if device.type != "cuda" or torch.version.hip:
        return None
    return torch.cuda.get_device_capability(device)[0]


def cublas_refusal(device: torch.device, x_dtype: torch.dtype, rows: int, n: int,
                   k: int) -> str:
    """Why a call of ``rows`` tokens of K = k into N = n channels cannot take the cuBLAS
    fp8 route,
    or "" when it can: an NVIDIA Hopper GPU (where
    it was built; torch's rowwise fp8 GEMM wants a bf16 output and N a multiple of 16),
    at least :func:`cublas_min_rows` rows. A weight's own fit (its column plan) is the
    caller's other condition."""
    gpu = _nvidia_major(device)
    if gpu is None:
        return f"{device} is not an NVIDIA GPU"
    if gpu != 9:
        return "not a Hopper GPU (sm_90), where the route is built and measured"
    if x_dtype != torch.bfloat16:
        return f"x is {x_dtype}, the route writes bf16"
    if n % 16:
        return f"N = {n} is not a multiple of 16"
    if rows < cublas_min_rows(k):
        return f"{rows} rows, fewer than the {cublas_min_rows(k)} from which it wins at K = {k}"
    return ""
