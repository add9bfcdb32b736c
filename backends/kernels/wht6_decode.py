"""wht6 decode kernel: one uint8 wht6 payload -> a [rows, cols] bf16/fp16/fp32 tensor.

Math (format in ``backends/wht6/__init__.py``): each 6-bit code (sign, q) becomes
+-L(q) * s_g in the rotated domain, with L(q) = t (3 + t) / 4, t = (2q + 1) / 63 and
s_g = S * (c_g / 63)^2 from the block record (S NaN for a block sent as NaN); each
sub-block is rotated back, x = H32 @ y (tensor cores, fp32 accumulation, the fp32
values split into exact bf16 pieces, rows of extreme values shifted by powers of two
so no partial sum overflows), and rounded once to the output dtype; a block that
overflows that dtype is NaN.

Each program decodes T consecutive sub-blocks in row-major order (T // 8 whole blocks).
"""

import torch

from backends import envs
import triton
import triton.language as tl

from backends.kernels import wht6_tile
from backends.wht6 import reference

# Launch shape: no spills and <= 96 registers per thread in ptxas for sm_90 (checked by
# compiling offline); not yet tuned by timing on a GPU.
SUBS_PER_PROGRAM = 32  # T: sub-blocks per program (1024 values, 4 blocks)
NUM_WARPS = 4
# bf16 pieces of the fp32 sums: 2 leave an error below 2**-16 relative, far under one
# bf16/fp16 rounding; fp32 output takes 3 (exact).
_SPLITS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 3}


@triton.jit
def wht6_decode_kernel(
    pay_ptr,  # *uint8, payload [rows, 25 * cols / 32], contiguous
    out_ptr,  # *bf16/fp16/fp32, output [rows, cols], unit column stride
    n_sub,  # rows * cols / 32: sub-blocks in the tensor
    subs_per_row,  # cols / 32
    out_row_stride,  # elements between consecutive rows of out
    pay_row_w64,  # payload row stride in int64 words (bytes / 8)
    T: tl.constexpr,  # sub-blocks per program, a multiple of 8
    SPLITS: tl.constexpr,  # bf16 pieces for the inverse rotation (2 or 3)
    DOT_FP32: tl.constexpr,  # multiply the pieces in fp32 (Triton interpreter)
):
    f0 = tl.program_id(0).to(tl.int64) * T
    y = wht6_tile.load_dequantize(pay_ptr, f0, n_sub, subs_per_row, pay_row_w64, T)
    x = wht6_tile.decode_tile(y, out_ptr.dtype.element_ty, T, SPLITS, DOT_FP32)
    ptrs, mask = wht6_tile.subblock_ptrs(out_ptr, f0, n_sub, subs_per_row, out_row_stride, T)
    tl.store(ptrs, x, mask=mask)


def wht6_decode(payload: torch.Tensor, shape: tuple, dtype: torch.dtype, out: torch.Tensor = None) -> torch.Tensor:
    """Decode a payload into [rows, cols] of ``dtype`` (``out`` if given). Checks,
    allocates, launches."""
    rows, cols = shape
    if cols % reference.BLOCK or dtype not in _SPLITS:
        raise ValueError(f"need cols % {reference.BLOCK} == 0 and a bf16/fp16/fp32 dtype, got {shape} {dtype}")
    pay_shape = (rows, reference.payload_bytes_per_row(cols))
    if payload.dtype != torch.uint8 or tuple(payload.shape) != pay_shape or not payload.is_contiguous():
        raise ValueError(f"payload must be a contiguous uint8 tensor of shape {pay_shape}")
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=payload.device)
    elif tuple(out.shape) != (rows, cols) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {dtype} of shape {(rows, cols)} with unit column stride")
    n_sub = rows * cols // reference.SUB
    if n_sub == 0:
        return out
    grid = (triton.cdiv(n_sub, SUBS_PER_PROGRAM),)
    wht6_decode_kernel[grid](
        payload, out, n_sub, cols // reference.SUB, out.stride(0), pay_shape[1] // 8,
        T=SUBS_PER_PROGRAM, SPLITS=_SPLITS[dtype],
        DOT_FP32=envs.triton_interpreter(),
        num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
