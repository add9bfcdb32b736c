"""wht6 decode-accumulate kernel: the sum of W <= 8 wht6 payloads -> one [rows, cols]
bf16/fp16/fp32 tensor, the reduce step of a compressed all-reduce.

Math (format in ``backends/wht6/__init__.py``): the rotation is linear, so the sum is
taken in the rotated domain: acc = y_0 + y_1 + ... + y_{W-1} in fp32, in payload order,
each y_w = +-L(q) * s_g / 8 dequantized as in the decode kernel (the 1/8 leaves room
for 8 payloads of any finite scale), then ONE inverse rotation x = H32 @ acc * 8
(tensor cores, fp32 accumulation, exact bf16 pieces, rows of extreme values shifted by
powers of two so no partial sum overflows) and ONE rounding to the output dtype. Every rank that passes
the payloads in the same order gets the same bits. A NaN block in any payload makes
that block of the sum NaN, and so does a block whose sum overflows the output dtype.

Each program reduces T consecutive sub-blocks in row-major order (T // 8 whole blocks).
"""

import torch

from backends import envs
import triton
import triton.language as tl

from backends.kernels import wht6_tile
from backends.wht6 import reference

# Launch shape: no spills and <= 96 registers per thread in ptxas for sm_90 (checked by
# compiling offline); not yet tuned by timing on a GPU.
SUBS_PER_PROGRAM = 16  # T: sub-blocks per program (512 values, 2 blocks)
NUM_WARPS = 4
MAX_PAYLOADS = 8  # 1 / reference.HEADROOM: the sum's fp32 headroom
_SPLITS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 3}  # as in wht6_decode


@triton.jit
def wht6_decode_accumulate_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7,  # *uint8 payloads [rows, 25 * cols / 32]; the first n_payloads are read
    out_ptr,  # *bf16/fp16/fp32, output [rows, cols], unit column stride
    n_sub,  # rows * cols / 32: sub-blocks in the tensor
    subs_per_row,  # cols / 32
    out_row_stride,  # elements between consecutive rows of out
    pay_row_w64,  # payload row stride in int64 words (bytes / 8), the same for all
    n_payloads,  # number of payloads summed, 1..8, in order p0, p1, ...
    T: tl.constexpr,  # sub-blocks per program, a multiple of 8
    SPLITS: tl.constexpr,  # bf16 pieces for the inverse rotation (2 or 3)
    DOT_FP32: tl.constexpr,  # multiply the pieces in fp32 (Triton interpreter)
):
    f0 = tl.program_id(0).to(tl.int64) * T
    acc = wht6_tile.load_dequantize(p0, f0, n_sub, subs_per_row, pay_row_w64, T)
    # A run-time loop, not an unrolled one: unrolled, the compiler hoists all W
    # payloads' loads and the kernel spills registers.
    for w in range(1, n_payloads):
        pay = tl.where(w == 1, p1, tl.where(w == 2, p2, tl.where(w == 3, p3, tl.where(
            w == 4, p4, tl.where(w == 5, p5, tl.where(w == 6, p6, p7))))))
        acc += wht6_tile.load_dequantize(pay, f0, n_sub, subs_per_row, pay_row_w64, T)
    x = wht6_tile.decode_tile(acc, out_ptr.dtype.element_ty, T, SPLITS, DOT_FP32)
    ptrs, mask = wht6_tile.subblock_ptrs(out_ptr, f0, n_sub, subs_per_row, out_row_stride, T)
    tl.store(ptrs, x, mask=mask)


def wht6_decode_accumulate(payloads: list, shape: tuple, dtype: torch.dtype,
                           out: torch.Tensor = None) -> torch.Tensor:
    """Sum of the payloads' tensors as [rows, cols] of ``dtype`` (``out`` if given).
    Checks, allocates, launches."""
    rows, cols = shape
    if cols % reference.BLOCK or dtype not in _SPLITS:
        raise ValueError(f"need cols % {reference.BLOCK} == 0 and a bf16/fp16/fp32 dtype, got {shape} {dtype}")
    if not 1 <= len(payloads) <= MAX_PAYLOADS:
        raise ValueError(f"need 1..{MAX_PAYLOADS} payloads, got {len(payloads)}")
    pay_shape = (rows, reference.payload_bytes_per_row(cols))
    for i, p in enumerate(payloads):
        if p.dtype != torch.uint8 or tuple(p.shape) != pay_shape or not p.is_contiguous():
            raise ValueError(f"payloads[{i}] must be a contiguous uint8 tensor of shape {pay_shape}")
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=payloads[0].device)
    elif tuple(out.shape) != (rows, cols) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {dtype} of shape {(rows, cols)} with unit column stride")
    n_sub = rows * cols // reference.SUB
    if n_sub == 0:
        return out
    padded = list(payloads) + [payloads[0]] * (MAX_PAYLOADS - len(payloads))
    grid = (triton.cdiv(n_sub, SUBS_PER_PROGRAM),)
    wht6_decode_accumulate_kernel[grid](
        *padded, out, n_sub, cols // reference.SUB, out.stride(0), pay_shape[1] // 8, len(payloads),
        T=SUBS_PER_PROGRAM, SPLITS=_SPLITS[dtype],
        DOT_FP32=envs.triton_interpreter(),
        num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
