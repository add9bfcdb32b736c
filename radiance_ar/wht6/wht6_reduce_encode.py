"""wht6 reduce-encode kernel: the sum of W <= 8 wht6 payloads, rounded to a dtype, encoded
again -- the middle step of a two-shot compressed all-reduce, in one pass.

Math: exactly ``encode(decode_accumulate(payloads, shape, dtype))`` (the format in
``radiance_ar/wht6/__init__.py``): per tile the fp32 sum of the W dequantized payloads
in payload order, ONE inverse rotation and ONE rounding to ``dtype``
(``wht6_tile_decode``), then those rounded values, read back as fp32, rotated and coded
(``wht6_tile_encode``). The decoded values never reach memory: where the two kernels
wrote and re-read 2 bytes per value (bf16), this one writes only the 0.78-byte payload.

Why one kernel: in the op a two-shot slice's reduce-scatter ends with these two steps
on the all-reduce's stream, and each kernel waits for the SMs of the GEMM slice then
running (a persistent cuBLAS kernel that holds every SM until it ends); two launches
could wait for two GEMM slices.

Each program takes T consecutive sub-blocks in row-major order (T // 8 whole blocks).
Traffic: 0.78 W + 0.78 bytes per value, one pass.
"""

import torch
import triton
import triton.language as tl

from radiance_ar.launch.fast_launch import launch
from radiance_ar.wht6 import wht6_launch, wht6_tile, wht6_tile_decode, wht6_tile_encode
from radiance_ar.wht6 import reference
from radiance_ar.wht6.wht6_decode_accumulate import check_payloads, padded_payloads


@triton.jit
def wht6_reduce_encode_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7,  # *uint8 payloads [rows, 25 * cols / 32]; the first n_payloads are read
    pay_out,  # *uint8, the sum's payload [rows, 25 * cols / 32], contiguous
    levels,  # *fp32 [64]: the dequantization factor of each code (wht6_launch.levels)
    n_sub,  # rows * cols / 32: sub-blocks in the tensor (< 2**31)
    subs_per_row,  # cols / 32
    pay_row_bytes,  # bytes of one payload row, 25 * cols / 32 (the same for all)
    n_payloads,  # number of payloads summed, 1..8, in order p0, p1, ...
    SUM_DTYPE: tl.constexpr,  # the dtype the sum is rounded to before it is encoded
    T: tl.constexpr,  # sub-blocks per program, a multiple of 32 * num_warps
    NV_SQRT: tl.constexpr,  # NVIDIA's sqrt fast path (wht6_tile): CUDA only
):
    row, j, ok = wht6_tile.tile_of(tl.program_id(0), T, n_sub, subs_per_row)
    a0, a1, a2, a3, sbits = wht6_tile_decode.sum_payloads(p0, p1, p2, p3, p4, p5, p6, p7, n_payloads,
                                                          row, j, ok, subs_per_row, pay_row_bytes, levels)
    x0, x1, x2, x3 = wht6_tile_decode.decode_tile(a0, a1, a2, a3, sbits, SUM_DTYPE, T)
    # Masked lanes (whole blocks past n_sub) code values that are never stored.
    nib, high, rec = wht6_tile_encode.encode_tile(x0.to(tl.float32), x1.to(tl.float32),
                                                  x2.to(tl.float32), x3.to(tl.float32),
                                                  T, NV_SQRT)
    wht6_tile.store_payload(pay_out, row, j, ok, subs_per_row, pay_row_bytes, nib, high, rec)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def wht6_reduce_encode(payloads: list, shape: tuple, dtype: torch.dtype,
                       out: torch.Tensor = None) -> torch.Tensor:
    """The payload of the payloads' sum rounded to ``dtype`` (``out`` if given), shape
    [rows, cols] the tensors'. Checks, allocates, launches."""
    rows, cols = shape
    pay_shape, n_sub = check_payloads(payloads, shape, dtype)
    if out is None:
        out = torch.empty(pay_shape, dtype=torch.uint8, device=payloads[0].device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != pay_shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of shape {pay_shape}")
    t, warps = wht6_launch.decode_shape(len(payloads))
    if n_sub == 0:
        return out
    padded = padded_payloads(payloads)
    launch(
        wht6_reduce_encode_kernel, (triton.cdiv(n_sub, t),),
        *padded, out, wht6_launch.levels(out.device), n_sub, cols // reference.SUB,
        pay_shape[1], len(payloads), SUM_DTYPE=_TL_DTYPES[dtype], T=t,
        NV_SQRT=wht6_launch.nv_sqrt(out.device), num_warps=warps, enable_fp_fusion=False)
    return out
