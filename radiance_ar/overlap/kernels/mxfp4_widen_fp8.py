"""MXFP4 weight widened to fp8 e4m3 with one power-of-two exponent per output channel.

Math, for packed e2m1 codes wq [N, K/2], e8m0 scales ws [N, K/32] (formats:
:mod:`radiance_ar.overlap.producer_mxfp4`) and a column plan's ``top`` [N] (the scale
byte of each output channel widened to E = 6,
:func:`radiance_ar.overlap.kernels.mxfp4_fp8_gemm.plan_columns`)::

    out[n, k] = e4m3( e2m1(wq[n, k]) * 2^E ),   E = clamp(ws[n, k // 32] - top[n], -14, 0) + 6

so that w[n, k] = out[n, k] * col_scale[n], col_scale = 2^(top - 127 - 6), exactly
wherever a block's unclamped E lies in [-8, 6], which a fitting plan guarantees for
every block holding a non-zero code (the proof: that module's doc); the clamp keeps the
arithmetic of zero-code blocks finite. The values are those the fp8 Triton GEMM widens
in registers; here they go to memory once per call for the GPU's own fp8 GEMM
(:mod:`radiance_ar.overlap.mxfp4_routes`).

Each value is encoded in integer arithmetic, no float conversion: a code's magnitude m
(3 bits) is 2^(x) (1 + f/2) with x = (m >> 1) - 1, f = m & 1 for m >= 2, and 2^-1 for
m = 1; times 2^E its e4m3 exponent field is F = x + E + 7, its mantissa f << 2; F >= 1 is
a normal byte ``F << 3 | f << 2``, F <= 0 (down to -2) the subnormal ``(8 | f << 2) >> (1 - F)``,
exact because the value is representable (the plan's guarantee). The 2026-12-04 H200 run of
the float version (fp16 bits, an fp32 product, Triton's fp8 cast, packed 16-bit stores)
wrote wrong bytes in every fourth column on the GPU while its interpreter bits were
right; this version uses none of those steps. It reads the codes 16 bits and writes the
bytes 32 bits at a time (four values a word, little-endian).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from radiance_ar import envs
from radiance_ar.overlap.kernels import lazy_jit, mxfp4_w4a8

MX_GROUP = mxfp4_w4a8.MX_GROUP
#: 64 channels x 256 values a program, 4 warps: the fastest of 10 shapes and two store
#: widths on the H200 (tools/results/2026-12-04-h200-mxfp4-widen/: at 5120 x 4352 0.096 ms,
#: 355 GB/s, where the byte-store kernel before it took 0.488 ms; 16-bit stores 0.100 ms)
BLOCK_N, BLOCK_K = 64, 256

tl: Any = None  # triton.language, bound at the first launch
_jitted: Any = None


def _mxfp4_widen_fp8_kernel(
    w_ptr,  # *int16 [N, K/4]: packed e2m1 codes, two bytes a word, element 4j in the
    #         low nibble of its low byte (little-endian)
    ws_ptr,  # *uint8 [N, K/32]: e8m0 scales
    top_ptr,  # *int32 [N]: the plan's top scale byte per channel (widened to E = 6)
    out_ptr,  # *int32 [N, K/4]: the widened weight's e4m3 bytes, four a word
    N,  # output channels
    K,  # input channels, a multiple of 32
    w_row_stride,  # int16 words between rows of the codes
    ws_row_stride,  # bytes between rows of the scales
    out_row_stride,  # int32 words between rows of out
    BLOCK_N: tl.constexpr,  # channels a program
    BLOCK_K: tl.constexpr,  # K values a program, a multiple of 32
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    load_n = tl.minimum(offs_n, N - 1)
    offs_w = tl.program_id(1) * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)  # words
    in_k = offs_w[None, :] < K // 4
    w = tl.load(w_ptr + load_n[:, None] * w_row_stride + offs_w[None, :], mask=in_k,
                other=0).to(tl.int32) & 0xFFFF
    # each word's own scale (8 words share one): a repeated load, no reshape
    ws = tl.load(ws_ptr + load_n[:, None] * ws_row_stride + (offs_w // 8)[None, :],
                 mask=in_k, other=127).to(tl.int32)
    top = tl.load(top_ptr + load_n)
    e = tl.minimum(tl.maximum(ws - top[:, None], -14), 0) + 6
    quad = (_e4m3_byte(w & 0xF, e) | (_e4m3_byte((w >> 4) & 0xF, e) << 8)
            | (_e4m3_byte((w >> 8) & 0xF, e) << 16) | (_e4m3_byte((w >> 12) & 0xF, e) << 24))
    mask = (offs_n[:, None] < N) & in_k
    tl.store(out_ptr + offs_n[:, None] * out_row_stride + offs_w[None, :], quad, mask=mask)


def _e4m3_byte(code, e):
    """The e4m3 byte of e2m1(``code``) * 2^``e`` (int32 tensors; module doc)."""
    m = code & 7
    normal_code = m >= 2
    x = tl.where(normal_code, (m >> 1) - 1, -1)
    mant = tl.where(normal_code, (m & 1) << 2, 0)
    f = x + e + 7
    sub = (8 | mant) >> tl.minimum(tl.maximum(1 - f, 0), 3)
    byte = tl.where(f >= 1, (f << 3) | mant, sub)
    return tl.where(m == 0, 0, byte) | ((code & 8) << 4)


def _kernel() -> Any:
    global _jitted
    if _jitted is None:
        global _e4m3_byte
        _jitted = lazy_jit.jit(_mxfp4_widen_fp8_kernel, globals())
        _e4m3_byte = lazy_jit.jit(_e4m3_byte, globals())
    return _jitted


def widen(w: torch.Tensor, w_scale: torch.Tensor, top: torch.Tensor,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [N, K] e4m3 with w = out * col_scale[:, None] for the plan whose ``top`` is
    given (module doc), on the current stream of w's device; allocated when not given."""
    n, half_k = w.shape if w.dim() == 2 else (-1, -1)
    k = 2 * half_k
    if w.dtype != torch.uint8 or w.dim() != 2 or k % MX_GROUP or w.stride(1) != 1:
        raise ValueError(f"mxfp4_widen_fp8: w must be packed e2m1 uint8 (N, K/2) with K a "
                         f"multiple of {MX_GROUP} and unit column stride, got "
                         f"{tuple(w.shape)} {w.dtype}")
    if w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != (n, k // MX_GROUP) \
            or w_scale.stride(1) != 1:
        raise ValueError(f"mxfp4_widen_fp8: w_scale must be e8m0 uint8 ({n}, {k // MX_GROUP}) "
                         f"with unit column stride, got {tuple(w_scale.shape)} {w_scale.dtype}")
    if top.dtype != torch.int32 or tuple(top.shape) != (n,) or not top.is_contiguous():
        raise ValueError(f"mxfp4_widen_fp8: top must be contiguous int32 ({n},) (the column "
                         f"plan's), got {tuple(top.shape)} {top.dtype}")
    if out is None:
        out = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    if out.dtype != torch.float8_e4m3fn or tuple(out.shape) != (n, k) or out.stride(1) != 1:
        raise ValueError(f"mxfp4_widen_fp8: out must be float8_e4m3fn ({n}, {k}) with unit "
                         f"column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if w.stride(0) % 2 or w.storage_offset() % 2 or out.stride(0) % 4 \
            or out.storage_offset() % 4:
        raise ValueError("mxfp4_widen_fp8: w's rows must start on 2-byte and out's on 4-byte "
                         "boundaries (the kernel reads 16-bit and writes 32-bit words), got "
                         f"strides {w.stride(0)} and {out.stride(0)}, offsets "
                         f"{w.storage_offset()} and {out.storage_offset()}")
    for label, t in (("w_scale", w_scale), ("top", top), ("out", out)):
        if t.device != w.device:
            raise ValueError(f"mxfp4_widen_fp8: {label} is on {t.device}, w on {w.device}")
    if w.device.type != "cuda" and not envs.triton_interpreter():
        raise ValueError(f"mxfp4_widen_fp8: w is on {w.device}; the kernel runs on CUDA/ROCm "
                         "GPUs (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1)")
    if n == 0:
        return out
    grid = (-(-n // BLOCK_N), -(-k // BLOCK_K))
    with torch.cuda.device(w.device) if w.device.type == "cuda" else contextlib.nullcontext():
        _kernel()[grid](w.view(torch.int16), w_scale, top, out.view(torch.int32), n, k,
                        w.stride(0) // 2, w_scale.stride(0), out.stride(0) // 4,
                        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out
