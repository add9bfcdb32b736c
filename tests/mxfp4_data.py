"""Operands of the MXFP4 GPU tests (tests/test_mxfp4.py, tests/test_mxfp4_fp8_gemm.py)."""

import torch

from radiance_ar.overlap import producer_mxfp4 as mx


def gpu_operands(rows: int, n: int, k: int, seed: int = 0):
    """(x, xq, xs, packed, scales) on the GPU: a bf16 activation of unit scale and a
    N(0, 1/K) weight, quantized by the references."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).cuda()
    packed, scales = mx.quantize_weight(w)
    xq, xs = mx.quantize_activation(x)
    return x, xq, xs, packed, scales
