"""wht6 decode-accumulate kernel: the sum of W <= 8 wht6 payloads -> one [rows, cols]
bf16/fp16/fp32 tensor, the reduce step of a compressed all-reduce (W = 1: a decode).

Math (format in ``radiance_ar/wht6/__init__.py``, per-tile helpers in ``wht6_tile``): the
rotation is linear, so the sum is taken in the rotated domain: acc = y_0 + y_1 + ... +
y_{W-1} in fp32, in payload order, each y_w = levels[code] * s_g with levels[code] =
+-L(q) / 8 read from a 64-entry table (the 1/8 leaves room for 8 payloads of any finite
scale) and s_g = S * (c_g / 63)^2 from the block record; then ONE inverse rotation
x = H32 acc * 8 (fp32 butterflies in registers; blocks with a scale >= 2**64 rotated
at 2**-5 so no partial sum overflows) and ONE rounding to the output dtype. Every rank
that passes the payloads in the same order gets the same bits. A NaN block in any
payload makes that block of the sum NaN, and so does a block whose sum overflows the
output dtype.

Each program reduces T consecutive sub-blocks in row-major order (T // 8 whole blocks).
Traffic: 0.78 W + 2 (bf16 out) bytes per value, one pass.
"""

import torch
import triton
import triton.language as tl

from radiance_ar.launch.fast_launch import launch
from radiance_ar.wht6 import wht6_launch, wht6_tile, wht6_tile_decode
from radiance_ar.wht6 import reference

MAX_PAYLOADS = 8  # 1 / reference.HEADROOM: the sum's fp32 headroom
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def wht6_decode_accumulate_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7,  # *uint8 payloads [rows, 25 * cols / 32]; the first n_payloads are read
    out_ptr,  # *bf16/fp16/fp32, output [rows, cols], unit column stride
    levels,  # *fp32 [64]: the dequantization factor of each code (wht6_launch.levels)
    n_sub,  # rows * cols / 32: sub-blocks in the tensor (< 2**31)
    subs_per_row,  # cols / 32
    out_row_stride,  # elements between consecutive rows of out
    pay_row_bytes,  # bytes of one payload row, 25 * cols / 32 (the same for all)
    n_payloads,  # number of payloads summed, 1..8, in order p0, p1, ...
    T: tl.constexpr,  # sub-blocks per program, a multiple of 32 * num_warps
):
    row, j, ok = wht6_tile.tile_of(tl.program_id(0), T, n_sub, subs_per_row)
    a0, a1, a2, a3, sbits = wht6_tile_decode.sum_payloads(p0, p1, p2, p3, p4, p5, p6, p7, n_payloads,
                                                          row, j, ok, subs_per_row, pay_row_bytes, levels)
    x0, x1, x2, x3 = wht6_tile_decode.decode_tile(a0, a1, a2, a3, sbits, out_ptr.dtype.element_ty, T)
    wht6_tile.store_values(out_ptr, row, j, ok, out_row_stride, 0, x0, x1, x2, x3, False)


def check_payloads(payloads: list, shape: tuple, dtype: torch.dtype) -> tuple:
    """(payload shape, sub-blocks) of a kernel call summing ``payloads`` of [rows, cols]
    tensors into ``dtype``; ``ValueError`` naming what is wrong."""
    rows, cols = shape
    if cols % reference.BLOCK or dtype not in DTYPES:
        raise ValueError(f"need cols % {reference.BLOCK} == 0 and a bf16/fp16/fp32 dtype, got {shape} {dtype}")
    if not 1 <= len(payloads) <= MAX_PAYLOADS:
        raise ValueError(f"need 1..{MAX_PAYLOADS} payloads, got {len(payloads)}")
    pay_shape = (rows, reference.payload_bytes_per_row(cols))
    for i, p in enumerate(payloads):
        if p.dtype != torch.uint8 or tuple(p.shape) != pay_shape or not p.is_contiguous():
            raise ValueError(f"payloads[{i}] must be a contiguous uint8 tensor of shape {pay_shape}")
    n_sub = rows * cols // reference.SUB
    if n_sub >= 2**31:
        raise ValueError(f"{rows}x{cols} is over 2**36 values; use row slices")
    return pay_shape, n_sub


def padded_payloads(payloads: list) -> list:
    """The kernel's 8 payload arguments: ``payloads`` and the first repeated (never read)."""
    return list(payloads) + [payloads[0]] * (MAX_PAYLOADS - len(payloads))


def wht6_decode_accumulate(payloads: list, shape: tuple, dtype: torch.dtype,
                           out: torch.Tensor = None, launch_shape: tuple = None) -> torch.Tensor:
    """Sum of the payloads' tensors as [rows, cols] of ``dtype`` (``out`` if given).
    ``launch_shape``: a (T, num_warps) instead of the table's (``wht6_launch``; the
    sweep's). Checks, allocates, launches."""
    rows, cols = shape
    pay_shape, n_sub = check_payloads(payloads, shape, dtype)
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=payloads[0].device)
    elif tuple(out.shape) != (rows, cols) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {dtype} of shape {(rows, cols)} with unit column stride")
    t, warps = (wht6_launch.decode_shape(len(payloads)) if launch_shape is None
                else wht6_launch.check_shape(launch_shape))
    if n_sub == 0:
        return out
    padded = padded_payloads(payloads)
    launch(
        wht6_decode_accumulate_kernel, (triton.cdiv(n_sub, t),),
        *padded, out, wht6_launch.levels(out.device), n_sub, cols // reference.SUB, out.stride(0),
        pay_shape[1], len(payloads), T=t, num_warps=warps, enable_fp_fusion=False)
    return out
