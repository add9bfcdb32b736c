"""GEMM producer ``mxfp4_w4a8``: fp8 activations, MXFP4 weights, bf16 (x's dtype) output.

Math, for an activation x [M, K] (bf16/fp16/fp32) and a quantized weight (wq, ws)::

    x_scale[m] = max(fl32(max_k |x[m, k]| / 448), 1e-12)    (one rounded division)
    xq[m, k]   = e4m3(x[m, k] / x_scale[m])          (round to nearest even)
    y[m, n]    = x_scale[m] * sum_k xq[m, k] * e2m1(wq[n, k]) * 2^(ws[n, k // 32] - 127)

Formats (OCP Microscaling Formats (MX) v1.0):

- ``weight`` [N, K/2] uint8: e2m1 codes (1 sign, 2 exponent, 1 mantissa bit; exponent
  bias 1), two per byte along K, element 2j in the low nibble. Magnitude codes 0..7 are
  0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
- ``weight_scale`` [N, K/32] uint8: e8m0, one per 32 consecutive K values of a row;
  byte e is 2^(e - 127); 255 is NaN.

:func:`quantize_weight` follows the spec's conversion (section 6.3): a block's shared
exponent is floor(log2(max |w|)) - 2 (2: the largest e2m1 exponent), clamped to the
e8m0 range, and each w / 2^X is rounded to the nearest e2m1 value, ties to even,
saturating at +-6. :func:`dequantize_weight` and :func:`reference` are the float
definition the kernel (:mod:`radiance_ar.overlap.kernels.mxfp4_w4a8`) is checked against.

The producer quantizes x per token in ``prepare`` (once per call, row-independent, so
slicing stays exact) and launches per row slice on the given stream one of three routes,
chosen per call in :func:`prepare` (:mod:`radiance_ar.overlap.mxfp4_routes`): the weight
widened to e4m3 in memory for torch's fp8 GEMM (``cublas_fp8``), widened in registers by
the fp8 Triton kernel (``triton_fp8``), or by the bf16 (or scaled-MMA) one (``triton_bf16``).
A Triton route's kernel config is chosen in ``prepare`` too, from the call's rows, so every
slice runs the unsliced call's config.
Triton is imported at the first launch: importing this module needs torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radiance_ar import envs
from radiance_ar.overlap import mxfp4_routes as routes
from radiance_ar.overlap import producers
from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fp8_kernel
from radiance_ar.overlap.kernels import mxfp4_w4a8 as kernel
from radiance_ar.overlap.kernels import mxfp4_widen_fp8 as widen_fp8
from radiance_ar.overlap.kernels.mxfp4_fp8_gemm import ColumnPlan
from radiance_ar.overlap import fp8_activation
from radiance_ar.overlap.producers import FP8, Prepared
from radiance_ar.overlap.scratch import ScratchPool

NAME = "mxfp4_w4a8"
#: the activation half of this producer's definition (module doc): per-token fp8
quantize_activation = fp8_activation.quantize_activation
MX_GROUP = kernel.MX_GROUP
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest e2m1 value, 6 = 1.5 * 2^2
E8M0_BIAS, E8M0_NAN = kernel.E8M0_BIAS, kernel.E8M0_NAN
#: |value| of the e2m1 magnitude codes 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Rounding |v| (<= 6) to the nearest e2m1 magnitude: the code is the number of these
#: midpoints below |v|; at a tie the even code wins, so ties at 0.25, 1.25, 2.5 and 5
#: stay below (strict >) and ties at 0.75, 1.75 and 3.5 go up (>=).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed e2m1 codes [N, K/2] uint8, e8m0 scales [N, K/32] uint8) of w [N, K]."""
    if w.dim() != 2 or not w.is_floating_point() or w.shape[1] % MX_GROUP:
        raise ValueError(f"quantize_weight: w must be a 2-D float tensor with K a multiple "
                         f"of {MX_GROUP}, got {tuple(w.shape)} {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_weight: w holds NaN or Inf; MXFP4 codes only finite values")
    n, k = w.shape
    blocks = w.double().reshape(n, k // MX_GROUP, MX_GROUP)
    amax = blocks.abs().amax(dim=2)
    # floor(log2(amax)) from frexp, exact: amax = f * 2^e with f in [0.5, 1).
    exp = torch.frexp(amax)[1].to(torch.int32) - 1 - E2M1_EMAX
    biased = torch.where(amax > 0, exp + E8M0_BIAS, torch.zeros_like(exp))
    biased = biased.clamp(0, E8M0_NAN - 1)
    scaled = blocks / torch.pow(2.0, (biased - E8M0_BIAS).double())[..., None]
    mag = scaled.abs().clamp_max(E2M1_MAX)
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for mid, tie_up in _MIDPOINTS:
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    code |= ((scaled < 0) & (code > 0)).to(torch.uint8) << 3
    code = code.reshape(n, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), biased.to(torch.uint8).contiguous()


def dequantize_weight(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [N, K] values of packed e2m1 codes and e8m0 scales (module doc)."""
    fp8_kernel.check_weight(packed, scales, "dequantize_weight")
    n = packed.shape[0]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=2).reshape(n, -1).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    exps = scales.double() - E8M0_BIAS
    factor = torch.where(scales == E8M0_NAN, torch.nan, torch.pow(2.0, exps))
    return (values.reshape(n, -1, MX_GROUP) * factor[..., None]).reshape(n, -1)


def dequantize_activation(xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """float64 [M, K] values of per-token scaled e4m3 codes."""
    return xq.double() * x_scale.double().reshape(-1, 1)


def reference(xq: torch.Tensor, x_scale: torch.Tensor, packed: torch.Tensor,
              scales: torch.Tensor) -> torch.Tensor:
    """float64 ``y = dequantize_activation(...) @ dequantize_weight(...).T``: the product of
    the dequantized operands, which the kernel computes up to fp32 sums and one rounding."""
    return dequantize_activation(xq, x_scale) @ dequantize_weight(packed, scales).t()


def check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """The producer's inputs: x [M, K] activation, weight [N, K/2] packed codes,
    weight_scale [N, K/32] e8m0 (``radiance::linear_ar``'s common checks aside)."""
    k = x.shape[1]
    if k % MX_GROUP:
        raise ValueError(f"producer {NAME}: K = {k} must be a multiple of {MX_GROUP}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != k // 2 \
            or not weight.is_contiguous():
        raise ValueError(f"producer {NAME}: weight must be contiguous packed e2m1 uint8 of "
                         f"shape (N, {k // 2}) for K = {k}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    shape = (weight.shape[0], k // MX_GROUP)
    if weight_scale is None or weight_scale.dtype != torch.uint8 \
            or tuple(weight_scale.shape) != shape or not weight_scale.is_contiguous():
        got = ("None" if weight_scale is None
               else f"{tuple(weight_scale.shape)} {weight_scale.dtype}")
        raise ValueError(f"producer {NAME}: weight_scale must be contiguous e8m0 uint8 of "
                         f"shape {shape}, one per {MX_GROUP} K values, got {got}")


@dataclass
class MxPrepared(Prepared):
    """:class:`Prepared` with the route the call takes and, on the Triton fp8 route, the
    weight's column plan."""
    route: str = "triton_bf16"
    plan: ColumnPlan | None = None
    #: the Triton routes' kernel config, chosen once from the CALL's rows: chosen per
    #: slice, slices of another size class took another config (another accumulation
    #: order), so slicing changed the bits (a review's spy, 2026-12-05)
    config: Any = None


#: fp8_rowwise's launch, which the cuBLAS route shares
_ROWWISE = producers.ScaledMMRowwise()


def prepare(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
            scratch: ScratchPool) -> Prepared:
    """Per-token fp8 quantization of x into a persistent buffer, on the caller's stream
    (:func:`radiance_ar.overlap.fp8_activation.quantize_tokens`: one kernel, the bits of
    :func:`quantize_activation`), then the route's weight (module doc of
    :mod:`radiance_ar.overlap.mxfp4_routes`):

    - ``cublas_fp8``: the weight widened to e4m3 into a persistent buffer, its column
      scales as the GEMM's rowwise weight scales;
    - ``triton_fp8``: the packed weight and its column plan;
    - ``triton_bf16``: the packed weight, the activation stored as the device's kernel
      configs read it (:func:`radiance_ar.overlap.kernels.mxfp4_w4a8.activation_dtype`).

    The scales are per-call tensors (the pipeline orders the caller's stream after every
    side-stream read before it returns)."""
    check(x, weight, weight_scale)
    assert weight_scale is not None  # check() refused None
    xq, x_scale = fp8_activation.quantize_tokens(
        x, scratch.get("mxfp4_xq", tuple(x.shape), FP8, x.device))
    if fp8_kernel.has_fp8_mma(x.device) or envs.triton_interpreter():
        plan = routes.cached_plan(weight, weight_scale)
        if plan.fits and not routes.cublas_refusal(x.device, x.dtype, x.shape[0],
                                                   weight.shape[0], x.shape[1]):
            w8 = scratch.get("mxfp4_w8", (weight.shape[0], x.shape[1]), FP8, x.device)
            widen_fp8.widen(weight, weight_scale, plan.top, out=w8)
            # fp8_rowwise's operands: per-token scales [M, 1], channel scales [1, N]
            return MxPrepared(xq, w8, x_scale.unsqueeze(1), plan.col_scale.reshape(1, -1),
                              "cublas_fp8")
        if plan.fits:
            config = fp8_kernel.launch_config(x.device, x.shape[0], weight.shape[0], x.shape[1])
            return MxPrepared(xq, weight, x_scale, weight_scale, "triton_fp8", plan, config)
    storage = kernel.activation_dtype(x.device)
    if storage != FP8:  # the same values, widened for this GPU's kernel configs
        xq = scratch.get("mxfp4_xq_wide", tuple(x.shape), storage, x.device).copy_(xq)
    return MxPrepared(xq, weight, x_scale, weight_scale, "triton_bf16",
                      config=kernel.launch_config(x.device, x.shape[0]))


def launch(p: Prepared, a: int, b: int, out: torch.Tensor, stream: int) -> None:
    """Rows ``a:b`` of the product into the view ``out`` on ``stream`` (a raw handle), by
    the prepared route; the cuBLAS route is the fp8_rowwise producer's launch (torch's fp8
    GEMM on the current stream, which the pipeline makes ``stream``)."""
    assert isinstance(p, MxPrepared)
    if p.route == "cublas_fp8":
        _ROWWISE.launch(p, a, b, out, stream)
    elif p.route == "triton_fp8":
        fp8_kernel.mxfp4_fp8_gemm(p.x[a:b], p.x_scale[a:b], p.weight, p.weight_scale, p.plan,
                                  out=out, stream=stream, config=p.config)
    else:
        kernel.mxfp4_w4a8_gemm(p.x[a:b], p.x_scale[a:b], p.weight, p.weight_scale, out=out,
                               stream=stream, config=p.config)


#: interior slices start on multiples of 16 rows: the fp8 route's rowwise GEMM needs its
#: slice of the fp32 per-token scales 16-byte aligned (as the fp8_rowwise producer's)
SLICE_ROW_ALIGN = _ROWWISE.slice_row_align
producers.register_external(NAME, launch, prepare=prepare, needs_weight_scale=True,
                            values_per_weight_element=2, check=check,
                            slice_row_align=SLICE_ROW_ALIGN)
