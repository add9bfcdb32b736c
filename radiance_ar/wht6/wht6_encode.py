"""wht6 encode kernel: a [rows, cols] bf16/fp16/fp32 tensor -> its uint8 wht6 payload.

Math (format in ``radiance_ar/wht6/__init__.py``, per-tile helpers in ``wht6_tile``):
each 32 consecutive values x of a row are rotated, y = H32 (x / 32) (entries +-1, fp32
butterflies in registers); the max |y| over each 256-value block, rounded up to bf16,
is the block scale S (a block holding NaN/Inf, or a non-zero one outside the coded
range, is sent as NaN); each sub-block g gets s_g = S * (c_g / 63)^2 with the smallest
6-bit c_g covering its max; each value gets a 6-bit code: sign and
q = floor((sqrt(|y| / s_g + 9/16) - 3/4) * 63).
Payload row r: [cols/2 B nibble plane | cols/4 B high-bit plane | cols/32 B records].

Each program encodes T consecutive sub-blocks in row-major order (T // 8 whole
blocks), so any number of rows works, and the input may have any row stride. Traffic:
2 (bf16) + 0.78 bytes per value, one pass.
"""

import torch
import triton
import triton.language as tl

from radiance_ar.launch.fast_launch import launch
from radiance_ar.wht6 import wht6_launch, wht6_tile, wht6_tile_encode
from radiance_ar.wht6 import reference


@triton.jit
def wht6_encode_kernel(
    x_ptr,  # *bf16/fp16/fp32, input [rows, cols], unit column stride
    pay_ptr,  # *uint8, output payload [rows, 25 * cols / 32], contiguous
    n_sub,  # rows * cols / 32: sub-blocks in the tensor (< 2**31)
    subs_per_row,  # cols / 32
    x_row_stride,  # elements between consecutive rows of x
    pay_row_bytes,  # bytes of one payload row, 25 * cols / 32
    row_magic,  # wht6_tile.row_divisor(subs_per_row): int32 bits of a uint32 multiplier
    row_shift,  # and its shift
    T: tl.constexpr,  # sub-blocks per program, a multiple of 32 * num_warps
    NV_SQRT: tl.constexpr,  # NVIDIA's sqrt fast path (wht6_tile): CUDA only
    WORDS: tl.constexpr = False,  # bf16 x with 4-byte aligned rows: read as 32-bit words
):
    row, j, ok = wht6_tile.tile_of(tl.program_id(0), T, n_sub, subs_per_row, WORDS,
                                   row_magic, row_shift)
    if WORDS:
        # Past the end (row, j) repeat the last sub-block: read unmasked, never stored.
        x0, x1, x2, x3, nz = wht6_tile.load_bf16_words(x_ptr, row, j, None, x_row_stride)
        nib, high, rec = wht6_tile_encode.encode_tile(x0, x1, x2, x3, T, NV_SQRT, nz)
    else:
        x0, x1, x2, x3 = wht6_tile.load_values(x_ptr, row, j, ok, x_row_stride, 0, False)
        nib, high, rec = wht6_tile_encode.encode_tile(x0, x1, x2, x3, T, NV_SQRT)
    wht6_tile.store_payload(pay_ptr, row, j, ok, subs_per_row, pay_row_bytes, nib, high, rec)


def wht6_encode(x: torch.Tensor, out: torch.Tensor = None, shape: tuple = None) -> torch.Tensor:
    """Encode x [rows, cols] into a payload (``out`` if given). ``shape``: a (T,
    num_warps) launch shape instead of the table's (``wht6_launch``; the sweep's).
    Checks, allocates, launches."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be 2-D bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    rows, cols = x.shape
    if cols % reference.BLOCK or x.stride(1) != 1:
        raise ValueError(f"x needs cols % {reference.BLOCK} == 0 and unit column stride, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    pay_shape = (rows, reference.payload_bytes_per_row(cols))
    if out is None:
        out = torch.empty(pay_shape, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != pay_shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of shape {pay_shape}")
    n_sub = rows * cols // reference.SUB
    if n_sub >= 2**31:
        raise ValueError(f"x of {rows}x{cols} is over 2**36 values; encode it in row slices")
    t, warps = wht6_launch.encode_shape(x.dtype) if shape is None else wht6_launch.check_shape(shape)
    if n_sub == 0:
        return out
    launch(
        wht6_encode_kernel, (triton.cdiv(n_sub, t),),
        x, out, n_sub, cols // reference.SUB, x.stride(0), pay_shape[1],
        *wht6_tile.row_divisor(cols // reference.SUB),
        T=t, NV_SQRT=wht6_launch.nv_sqrt(x.device),
        WORDS=x.dtype == torch.bfloat16 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0,
        num_warps=warps, enable_fp_fusion=False)
    return out
