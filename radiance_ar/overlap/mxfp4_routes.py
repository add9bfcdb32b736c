"""The fp8 route of ``mxfp4_w4a8``: which MXFP4 weights widen exactly to fp8 e4m3, and how.

An e2m1 code times its block's power-of-two scale 2^s is an e4m3 value times 2^c for a
channel exponent c whenever s - c lies in [-8, 6]
(:mod:`radiance_ar.overlap.kernels.mxfp4_widen_fp8`). Per output channel n::

    top[n] = the largest scale byte of a block of row n holding a non-zero code
    c[n]   = top[n] - 127 - 6            (that block widens to t = 6: at most 6 * 2^6 = 384)

and the channel FITS when every block with a non-zero code has a scale byte within 14 of
top[n] (the e4m3 range, 2^-9 .. 448, spans 2^14 of block exponents), no scale byte is 255
(NaN: the Triton route propagates it) and 2^c[n] is a normal fp32 (top >= 7). Blocks of
zero codes are zero whatever their scale (an all-zero block's scale is byte 0,
2^-127, from :func:`radiance_ar.overlap.producer_mxfp4.quantize_weight`).

When every channel fits, a call widens the weight to e4m3 once (N x K bytes in a scratch
buffer) and runs the GPU's fp8 GEMM with rowwise scales: the activation's per-token scale
and 2^c[n] per channel, both applied in the GEMM's epilogue. The products are exact; 2^c
changes no bit of the sum (a power of two), so the result is the fp32 sum of the exact
products times x_scale, rounded to bf16, as on the Triton route (up to summation order
and the fp8 GEMM's accumulation).

A weight with a channel that does not fit takes the Triton route (exact, slower); a
warning names the count. The check reads the whole weight and synchronizes, so it runs
once per weight and is cached by the scale tensor, invalidated when either tensor is
written in place (their version counters) or replaced. Under CUDA-graph capture an
unchecked weight is refused: one eager call per weight first (vLLM's warm-up is one).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from radiance_ar.overlap.kernels import mxfp4_widen_fp8

E8M0_NAN = 255
#: scale bytes a channel's non-zero blocks may span: the e4m3 block exponents -8 .. 6
SPAN = mxfp4_widen_fp8.T_MAX - mxfp4_widen_fp8.T_MIN
#: the smallest top byte with 2^c a normal fp32: c = top - 133 >= -126
MIN_TOP = 7
#: The fp8 route pays the widening, N x K bytes written and read again (at 8192 x 5120 x
#: 4352 about 0.02 ms against a 0.30 ms fp8 GEMM); below this many rows the Triton route,
#: which reads the 4-bit weight directly, is expected to win. Estimated from the H200's
#: bench numbers (break-even near 180 rows at 339 vs 1222 TFLOP/s and 3.3 TB/s), not yet
#: measured: tools/bench_mxfp4.py --routes times both routes per M.
MIN_ROWS = 256


@dataclass(frozen=True)
class Fp8Plan:
    channel_exp: torch.Tensor  # int32 [N]: c, the widening's channel exponents
    channel_scale: torch.Tensor  # fp32 [1, N]: 2^c, the GEMM's rowwise weight scales
    misfits: int  # channels that do not fit (the route is usable when 0)


def make_plan(w: torch.Tensor, w_scale: torch.Tensor) -> Fp8Plan:
    """The plan of packed e2m1 codes w [N, K/2] and e8m0 scales w_scale [N, K/32] (module
    doc); one synchronization (the misfit count)."""
    n, groups = w_scale.shape
    nonzero = ((w & 0x77) != 0).reshape(n, groups, -1).any(dim=2)
    s = w_scale.to(torch.int32)
    top = torch.where(nonzero, s, -1).amax(dim=1)
    low = torch.where(nonzero, s, E8M0_NAN + 1).amin(dim=1)
    has_values = top >= 0
    fits = ~has_values | ((top - low <= SPAN) & (top >= MIN_TOP))
    fits &= ~(w_scale == E8M0_NAN).any(dim=1)
    exp = torch.where(has_values, top - 127 - mxfp4_widen_fp8.T_MAX, 0).to(torch.int32)
    scale = torch.ldexp(torch.ones(n, dtype=torch.float32, device=w.device), exp)
    return Fp8Plan(exp.contiguous(), scale.reshape(1, n).contiguous(), int((~fits).sum()))


#: plans by scale tensor: (the versions and codes they were made from, the plan)
_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _stamp(w: torch.Tensor, w_scale: torch.Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), w._version, w_scale.data_ptr(), w_scale._version)


def cached_plan(w: torch.Tensor, w_scale: torch.Tensor) -> Fp8Plan:
    """The plan of this weight, made at its first call (or after it was rewritten)."""
    stamp = _stamp(w, w_scale)
    hit = _PLANS.get(w_scale)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("producer mxfp4_w4a8: this weight's fp8 plan is made at its first "
                           "call, which synchronizes: run one eager call with the weight "
                           "before capturing a CUDA graph (or after rewriting the weight)")
    plan = make_plan(w, w_scale)
    if plan.misfits:
        warnings.warn(f"mxfp4_w4a8: {plan.misfits} of {w.shape[0]} output channels have "
                      f"block scales spanning more than 2^{SPAN} (or NaN scales): this "
                      "weight runs on the Triton route, not the fp8 GEMM", stacklevel=3)
    _PLANS[w_scale] = (stamp, plan)
    return plan


def available(device: torch.device, x_dtype: torch.dtype, rows: int, n: int) -> bool:
    """Whether a call of ``rows`` tokens into N = n channels can take the fp8 route here:
    an NVIDIA Hopper GPU (the GPU this route was built and measured for, whose Triton
    route emulates the scaled MMA; torch's rowwise fp8 GEMM wants a bf16 output and N a
    multiple of 16), at least :data:`MIN_ROWS` rows."""
    if device.type != "cuda" or torch.version.hip or x_dtype != torch.bfloat16:
        return False
    if rows < MIN_ROWS or n % 16:
        return False
    return torch.cuda.get_device_capability(device)[0] == 9
