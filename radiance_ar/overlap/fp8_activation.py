"""Per-token fp8 e4m3 quantization of activations: the definition, and its kernel.

Math, per row m of x [M, K] (bf16, fp16 or fp32)::

    x_scale[m] = max(fl32(max_k |x[m, k]| / 448), 1e-12)    (one rounded division)
    xq[m, k]   = e4m3(x[m, k] / x_scale[m])          (rounded to nearest, ties even)

:func:`quantize_activation` is that definition in torch; where kernels run (a GPU, or
Triton's interpreter) :func:`quantize_tokens` computes the same bits in one pass
(:mod:`radiance_ar.overlap.kernels.quantize_fp8_rows`: 0.034-0.036 ms at 8192 x 4352 on
an H200 against 0.34 ms for torch's four passes, tools/results/2026-12-04-h200-quantize-fp8-rows/). The producers that take per-token fp8 activations (``fp8_rowwise``,
``mxfp4_w4a8``) quantize through :func:`quantize_tokens`.
"""

from __future__ import annotations

import torch

from radiance_ar import envs
from radiance_ar.overlap.kernels.quantize_fp8_rows import FP8, FP8_MAX, MIN_SCALE, quantize_fp8_rows


def quantize_activation(x: torch.Tensor, out: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq fp8 e4m3 [M, K], x_scale fp32 [M]) with x ~ x_scale[:, None] * xq (module doc),
    in torch: the definition the kernel is checked against."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quantize_activation: x must be a 2-D float tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    # The divisor is a tensor on x's device: torch on CUDA divides by a Python number as
    # a multiplication by its rounded reciprocal (ATen's div_true_kernel_cuda), whose
    # bits differ from the division's in about half of the cases (x * fl32(1/448) against
    # x / 448 in fp32, torch on the CPU: 546641 of 1e6 values uniform in [0, 100), seed 0);
    # the division, rounded once, is the definition on every device.
    divisor = torch.full((), FP8_MAX, dtype=torch.float32, device=x.device)
    x_scale = (x.abs().amax(dim=1).float() / divisor).clamp_min(MIN_SCALE)
    if out is None:
        out = torch.empty(x.shape, dtype=FP8, device=x.device)
    torch.div(x.float(), x_scale[:, None], out=out)
    return out, x_scale


def quantize_tokens(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq in ``out``, x_scale [M]) on the current stream: the one-pass kernel where
    kernels run, elsewhere (a CPU without the interpreter) :func:`quantize_activation`;
    the same bits either way. ``x_scale`` is a new tensor of the call."""
    if x.is_cuda or envs.triton_interpreter():
        return quantize_fp8_rows(x, out=out)
    return quantize_activation(x, out=out)
