"""wht6 encode kernel: a [rows, cols] bf16/fp16/fp32 tensor -> its uint8 wht6 payload.

Math (format in ``backends/wht6/__init__.py``): each 32 consecutive values x of a row
are rotated, y = H32 @ x / 32 (entries +-1, on tensor cores with fp32 accumulation,
rows shifted by powers of two so nothing overflows); the max |y| over each 256-value
block, rounded up to bf16, is the block scale S (a block holding NaN/Inf, or a
non-zero one outside the coded range, is sent as NaN); each sub-block g gets
s_g = S * (c_g / 63)^2 with the smallest 6-bit c_g covering its max; each value gets
a 6-bit code: sign and q = floor((sqrt(|y| / s_g + 9/16) - 3/4) * 63).
Payload row r: [cols/2 B nibble plane | cols/4 B high-bit plane | cols/32 B records].

Each program encodes T consecutive sub-blocks in row-major order (T // 8 whole blocks),
so any number of rows works, and the input may have any row stride.
"""

import torch

from backends import envs
import triton
import triton.language as tl

from backends.kernels import wht6_tile
from backends.wht6 import reference

# Launch shape: no spills and <= 96 registers per thread in ptxas for sm_90 (checked by
# compiling offline); not yet tuned by timing on a GPU.
SUBS_PER_PROGRAM = 64  # T: sub-blocks per program (2048 values, 8 blocks)
NUM_WARPS = 8
_SPLITS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}  # exact bf16 pieces


@triton.jit
def wht6_encode_kernel(
    x_ptr,  # *bf16/fp16/fp32, input [rows, cols], unit column stride
    pay_ptr,  # *uint8, output payload [rows, 25 * cols / 32], contiguous
    n_sub,  # rows * cols / 32: sub-blocks in the tensor
    subs_per_row,  # cols / 32
    x_row_stride,  # elements between consecutive rows of x
    pay_row_w64,  # payload row stride in int64 words (bytes / 8)
    T: tl.constexpr,  # sub-blocks per program, a multiple of 8
    SPLITS: tl.constexpr,  # bf16 pieces that represent the input exactly (1..3)
    DOT_FP32: tl.constexpr,  # multiply the pieces in fp32 (Triton interpreter)
):
    f0 = tl.program_id(0).to(tl.int64) * T
    ptrs, mask = wht6_tile.subblock_ptrs(x_ptr, f0, n_sub, subs_per_row, x_row_stride, T)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    nib, high, rec = wht6_tile.encode_tile(x, T, SPLITS, DOT_FP32)
    nib_ptrs, high_ptrs, rec_ptrs, sub_mask, blk_mask = wht6_tile.payload_ptrs(
        pay_ptr, f0, n_sub, subs_per_row, pay_row_w64, T)
    tl.store(nib_ptrs, nib, mask=sub_mask[:, None])
    tl.store(high_ptrs, high, mask=sub_mask[:, None])
    tl.store(rec_ptrs, rec, mask=blk_mask)


def wht6_encode(x: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """Encode x [rows, cols] into a payload (``out`` if given). Checks, allocates, launches."""
    if x.dim() != 2 or x.dtype not in _SPLITS:
        raise ValueError(f"x must be 2-D bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    rows, cols = x.shape
    if cols % reference.BLOCK or x.stride(1) != 1:
        raise ValueError(f"x needs cols % {reference.BLOCK} == 0 and unit column stride, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    shape = (rows, reference.payload_bytes_per_row(cols))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of shape {shape}")
    n_sub = rows * cols // reference.SUB
    if n_sub == 0:
        return out
    grid = (triton.cdiv(n_sub, SUBS_PER_PROGRAM),)
    wht6_encode_kernel[grid](
        x, out, n_sub, cols // reference.SUB, x.stride(0), shape[1] // 8,
        T=SUBS_PER_PROGRAM, SPLITS=_SPLITS[x.dtype],
        DOT_FP32=envs.triton_interpreter(),
        num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
