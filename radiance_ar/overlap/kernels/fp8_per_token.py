"""Per-token fp8 e4m3 quantization of an activation in one pass: amax, scale, cast.

Math, for row m of x [rows, K] (bf16, fp16 or fp32), the fp32 operations of the reference
(:func:`radiance_ar.overlap.producer_mxfp4.quantize_activation`) in its order, so the
bits are the reference's::

    scale[m] = max(fl32(max_k |x[m, k]| / 448), fl32(1e-12))      (IEEE division)
    q[m, k]  = e4m3(fl32(x[m, k] / scale[m]))        (IEEE division, nearest even)

|x| / scale is at most 448 (1 + 2^-23), which rounds to 448: no value saturates, and the
floor keeps an all-zero row at zero codes rather than NaN. Stored as fp8 codes
(``torch.float8_e4m3fn``) or the same values widened to bf16 (exact), for GEMM configs
that read bf16. Inputs are finite (NaN/Inf rows are not defined here).

One pass: where a row fits one tile (K <= ONE_PASS_MAX_K, every prefill shape of the
bench's models: K <= 7168) it is read from memory once and kept in registers between the
max and the cast; longer rows are read twice, the second time from L2. The reference in
torch runs 5 passes with an fp32 copy of x (0.511 ms at 8192 x 4352 on the H200,
docs/history.md); this moves 3 bytes a value (bf16 in, e4m3 out).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from radiance_ar import envs
from radiance_ar.overlap.kernels import lazy_jit

E4M3_MAX = 448.0
MIN_SCALE = 1e-12  # the reference's floor
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Q_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)
#: the longest row read once (a tile of 8192 fp32 values: 32 a thread at 8 warps)
ONE_PASS_MAX_K = 8192
TWO_PASS_BLOCK_K = 4096
#: values a program covers at least (short rows: several rows a program)
PROGRAM_VALUES = 4096

tl: Any = None  # triton.language, bound at the first launch
_jitted: Any = None


def _to_e4m3(v, ROUND_BY_HAND: tl.constexpr):
    """fp32 v (|v| <= 464) -> e4m3, nearest even. Triton 3.9's interpreter rounds this cast
    wrongly (124.2 -> 64, a lost carry; 17 -> 18, ties up), so there v is first rounded to
    the e4m3 grid in fp32: the step of v's binade is 2^(e - 3) (e its exponent, at least
    -6, the smallest normal one: below it the subnormal step 2^-9), and (v + M) - M with
    M = 1.5 * 2^23 * step rounds v to a multiple of the step, nearest even, exactly."""
    if ROUND_BY_HAND:
        bits = v.to(tl.int32, bitcast=True)
        biased = tl.maximum((bits >> 23) & 0xFF, 121)
        magic = (((biased + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
        rounded = ((v + magic) - magic).to(tl.int32, bitcast=True)
        # the sign back onto a zero (the cast keeps it: -tiny -> -0)
        v = (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv)


def _fp8_per_token_kernel(
    x_ptr,  # *bf16/fp16/fp32 [rows, K]: the activation, unit column stride
    q_ptr,  # *fp8e4nv or *bf16 [rows, K]: the e4m3 codes (or their bf16 values)
    scale_ptr,  # *fp32 [rows]: per-token scales
    rows,  # tokens
    K,  # values a token
    x_row_stride,  # elements between rows of x
    q_row_stride,  # elements between rows of q
    ROWS: tl.constexpr,  # tokens a program
    BLOCK_K: tl.constexpr,  # values a tile row: >= K when ONE_PASS
    ONE_PASS: tl.constexpr,  # the row fits one tile: read once
    ROUND_BY_HAND: tl.constexpr,  # round to the e4m3 grid before the cast (interpreter)
):
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = offs_m < rows
    load_m = tl.minimum(offs_m, rows - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + load_m[:, None] * x_row_stride
    q_rows = q_ptr + load_m[:, None] * q_row_stride
    if ONE_PASS:
        x = tl.load(x_rows + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = tl.load(x_rows + k0 + offs_k[None, :], mask=k0 + offs_k[None, :] < K, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xk.to(tl.float32)), axis=1))
    scale = tl.maximum(tl.math.div_rn(amax, E4M3_MAX), MIN_SCALE)
    tl.store(scale_ptr + offs_m, scale, mask=row_ok)
    if ONE_PASS:
        q = _to_e4m3(tl.math.div_rn(x, scale[:, None]), ROUND_BY_HAND)
        tl.store(q_rows + offs_k[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_k[None, :] < K))
    else:
        for k0 in range(0, K, BLOCK_K):
            inside = k0 + offs_k[None, :] < K
            xk = tl.load(x_rows + k0 + offs_k[None, :], mask=inside, other=0.0)
            q = _to_e4m3(tl.math.div_rn(xk.to(tl.float32), scale[:, None]), ROUND_BY_HAND)
            tl.store(q_rows + k0 + offs_k[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & inside)


def _kernel() -> Any:
    global _jitted
    if _jitted is None:
        global _to_e4m3
        _jitted = lazy_jit.jit(_fp8_per_token_kernel, globals(), do_not_specialize=["rows"])
        _to_e4m3 = lazy_jit.jit(_to_e4m3, globals())
    return _jitted


def _check(x: torch.Tensor, out: torch.Tensor | None, scale: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in X_DTYPES \
            or x.stride(1) != 1:
        raise ValueError(f"fp8_per_token: x must be a 2-D tensor of one of {X_DTYPES} with "
                         f"unit column stride, got {getattr(x, 'shape', x)!r}")
    if x.device.type != "cuda" and not envs.triton_interpreter():
        raise ValueError(f"fp8_per_token: x is on {x.device}; the kernel runs on CUDA/ROCm "
                         "GPUs (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1)")
    if out is not None and (out.dtype not in Q_DTYPES or out.shape != x.shape
                            or out.stride(1) != 1 or out.device != x.device):
        raise ValueError(f"fp8_per_token: out must be {tuple(x.shape)} of one of {Q_DTYPES} "
                         f"with unit column stride on {x.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (x.shape[0],)
                              or not scale.is_contiguous() or scale.device != x.device):
        raise ValueError(f"fp8_per_token: scale must be contiguous float32 of shape "
                         f"({x.shape[0]},) on {x.device}, got {tuple(scale.shape)} {scale.dtype}")


def quantize(x: torch.Tensor, out: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, K] e4m3 codes or their bf16 values, scale fp32 [rows]) of x (module doc),
    on x's device's current stream; allocates what is not given (q as e4m3)."""
    _check(x, out, scale)
    rows, k = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if scale is None:
        scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or k == 0:
        return out, scale.fill_(MIN_SCALE)
    one_pass = k <= ONE_PASS_MAX_K
    block_k = 1 << (k - 1).bit_length() if one_pass else TWO_PASS_BLOCK_K
    per_program = max(1, PROGRAM_VALUES // block_k)
    grid = (-(-rows // per_program),)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _kernel()[grid](x, out, scale, rows, k, x.stride(0), out.stride(0),
                        ROWS=per_program, BLOCK_K=block_k, ONE_PASS=one_pass,
                        ROUND_BY_HAND=envs.triton_interpreter(),
                        num_warps=8 if per_program * block_k >= 4096 else 4)
    return out, scale
