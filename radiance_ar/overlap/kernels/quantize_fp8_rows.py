"""Per-token fp8 quantization of activations in one pass: amax, scale, cast.

Math, per row m of x [rows, K] (bf16, fp16 or fp32), in fp32 with IEEE rounding::

    scale[m] = max(fl(max_k |x[m, k]|) / 448, 1e-12)      (division rounded to nearest)
    q[m, k]  = e4m3(x[m, k] / scale[m])                    (division rounded to nearest,
                                                            then to nearest e4m3, ties even)

which is bit for bit :func:`radiance_ar.overlap.producer_mxfp4.quantize_activation`
(torch: ``amax``, ``/ 448``, ``clamp_min(1e-12)``, ``x.float() / scale``, ``.to(e4m3)``):
the divisions are ``div_rn`` (Triton's ``/`` on fp32 is an approximate division on
CUDA); |x / scale| <= 448 (1 + 2^-23) rounds to 448 at most, so the cast's saturation
(Triton) and overflow to NaN (torch) never differ; a row holding a NaN gets a NaN scale
and NaN codes as in torch (whose ``amax`` propagates NaN; Triton's ``max`` does not).

Memory: a row is read once (held in registers, as two power-of-two tiles so that little
work is masked) and written once as fp8, plus 4 bytes of scale: 3 bytes a bf16 element,
107 MB at 8192 x 4352, 22 us at the H200's 4.8 TB/s. The IEEE divisions (div_rn, about
10 instructions a value on sm_90) stay near that: the SASS count (Triton 3.9 offline)
gives about 17 us of issue at 8192 x 4352, where one 8192-wide tile would take 32.
Rows longer than :data:`ONE_PASS_MAX_K` are read twice (amax, then cast), the second
read mostly from L2.

Triton is imported at the first launch (``TRITON_INTERPRET=1`` set before that runs the
kernel on CPU tensors, as the tests do).
"""

from __future__ import annotations

from typing import Any

import torch

from radiance_ar import envs
from radiance_ar.overlap.kernels import lazy_jit

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 (e4m3fn) value
MIN_SCALE = 1e-12  # per-token scale floor: an all-zero row quantizes to zeros, not NaN
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: rows up to this long are held in registers whole (16 KB of fp32 a row for 16 warps at
#: most); every prefill shape of tools/model_shapes.py (K <= 7168) is one pass
ONE_PASS_MAX_K = 16384
LOOP_BLOCK_K = 4096  # chunk of a longer row

tl: Any = None  # triton.language, bound by _kernel() at the first launch
_jitted: Any = None


def _quantize_fp8_rows_kernel(
    x_ptr,  # *bf16/fp16/fp32 [rows, K]: activations, unit column stride
    q_ptr,  # *fp8e4nv [rows, K]: the codes out, unit column stride
    s_ptr,  # *fp32 [rows]: the per-token scales out
    K,  # columns
    x_row_stride,  # elements between consecutive rows of x
    q_row_stride,  # elements between consecutive rows of q
    ONE_PASS: tl.constexpr,  # K <= BLOCK_K + TAIL_K: the row stays in registers
    GRID_IN_FP32: tl.constexpr,  # cast by _e4m3_by_fp32_grid (Triton's interpreter)
    BLOCK_K: tl.constexpr,  # columns per load (one pass: the largest power of two <= K)
    TAIL_K: tl.constexpr,  # one pass: a power of two >= K - BLOCK_K, or 0
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        # two power-of-two tiles (Triton's shapes) cover K with little masked work:
        # 4352 = 4096 + 256 where one tile would be 8192
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        nans = tl.sum((x != x).to(tl.int32), axis=0)
        if TAIL_K > 0:
            offs_t = BLOCK_K + tl.arange(0, TAIL_K)
            xt = tl.load(x_row + offs_t, mask=offs_t < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=0))
            nans += tl.sum((xt != xt).to(tl.int32), axis=0)
    else:
        amax = tl.zeros((), tl.float32)
        nans = tl.zeros((), tl.int32)
        for k0 in range(0, K, BLOCK_K):
            part = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(part), axis=0))
            nans += tl.sum((part != part).to(tl.int32), axis=0)
    amax = tl.where(nans > 0, float("nan"), amax)
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12, propagate_nan=tl.PropagateNan.ALL)
    tl.store(s_ptr + row, scale)
    if ONE_PASS:
        q = tl.math.div_rn(x, scale)
        q8 = _e4m3_by_fp32_grid(q) if GRID_IN_FP32 else q.to(tl.float8e4nv)
        tl.store(q_row + offs, q8, mask=offs < K)
        if TAIL_K > 0:
            qt = tl.math.div_rn(xt, scale)
            qt8 = _e4m3_by_fp32_grid(qt) if GRID_IN_FP32 else qt.to(tl.float8e4nv)
            tl.store(q_row + offs_t, qt8, mask=offs_t < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            part = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            q = tl.math.div_rn(part, scale)
            q8 = _e4m3_by_fp32_grid(q) if GRID_IN_FP32 else q.to(tl.float8e4nv)
            tl.store(q_row + k0 + offs, q8, mask=k0 + offs < K)


def _e4m3_by_fp32_grid(v):
    """e4m3 codes of v (fp32, |v| <= 448 or NaN), rounded to nearest, ties to even, for
    Triton's interpreter, whose fp32 -> fp8 cast rounds ties up, truncates subnormals and
    garbles NaN (the GPU's cvt.rn does it right). |v| is rounded on the e4m3 grid in
    fp32 -- (|v| + c) - c with c = 1.5 * 2^(23 + log2 q), q the e4m3 spacing at |v|:
    2^(e - 3) in the binade 2^e (e >= -6), 2^-9 among subnormals -- so that the cast of
    it is exact; then the sign is put back (-0 stays -0) and NaN becomes 0x7F."""
    bits = v.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    magic = (((tl.maximum(e, -6) + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    mag = (tl.abs(v) + magic) - magic
    codes = mag.to(tl.float8e4nv).to(tl.uint8, bitcast=True) | ((bits >> 24) & 0x80).to(tl.uint8)
    return tl.where(v == v, codes, 0x7F).to(tl.float8e4nv, bitcast=True)


def _kernel() -> Any:
    global _jitted, _e4m3_by_fp32_grid
    if _jitted is None:
        _e4m3_by_fp32_grid = lazy_jit.jit(_e4m3_by_fp32_grid, globals())
        _jitted = lazy_jit.jit(_quantize_fp8_rows_kernel, globals())
    return _jitted


def _check(x: torch.Tensor, out: torch.Tensor | None, scale_out: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_fp8_rows: x must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cuda" and not envs.triton_interpreter():
        raise ValueError(f"quantize_fp8_rows: x is on {x.device}; the kernel runs on CUDA/ROCm "
                         "GPUs (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1)")
    if x.dim() != 2 or x.dtype not in X_DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"quantize_fp8_rows: x must be 2-D {' or '.join(map(str, X_DTYPES))} "
                         f"with unit column stride, got {tuple(x.shape)} {x.dtype} "
                         f"strides {x.stride()}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != FP8
                            or tuple(out.shape) != tuple(x.shape) or out.device != x.device
                            or (x.shape[1] > 1 and out.stride(1) != 1)):
        raise ValueError(f"quantize_fp8_rows: out must be {FP8} of shape {tuple(x.shape)} on "
                         f"{x.device} with unit column stride, got "
                         f"{getattr(out, 'shape', out)} {getattr(out, 'dtype', '')}")
    if scale_out is not None and (not isinstance(scale_out, torch.Tensor)
                                  or scale_out.dtype != torch.float32
                                  or tuple(scale_out.shape) != (x.shape[0],)
                                  or scale_out.device != x.device
                                  or not scale_out.is_contiguous()):
        raise ValueError(f"quantize_fp8_rows: scale_out must be contiguous float32 of shape "
                         f"({x.shape[0]},) on {x.device}, got "
                         f"{getattr(scale_out, 'shape', scale_out)} "
                         f"{getattr(scale_out, 'dtype', '')}")


def quantize_fp8_rows(x: torch.Tensor, out: torch.Tensor | None = None,
                      scale_out: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [rows, K], scale fp32 [rows]) with x ~ scale[:, None] * q (module doc), on
    the current stream; ``out`` and ``scale_out`` are allocated when not given."""
    _check(x, out, scale_out)
    rows, k = x.shape
    if out is None:
        out = torch.empty((rows, k), dtype=FP8, device=x.device)
    if scale_out is None:
        scale_out = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, scale_out
    one_pass = k <= ONE_PASS_MAX_K
    if one_pass:
        block_k = max(16, 1 << (k.bit_length() - 1))  # the largest power of two <= K
        tail_k = 0 if k <= block_k else max(16, 1 << (k - block_k - 1).bit_length())
    else:
        block_k, tail_k = LOOP_BLOCK_K, 0
    # 16 values a thread while the row is in registers
    num_warps = min(16, max(1, (block_k + tail_k) // 512))
    _kernel()[(rows,)](x, out, scale_out, k, x.stride(0), out.stride(0),
                       ONE_PASS=one_pass, GRID_IN_FP32=envs.triton_interpreter(),
                       BLOCK_K=block_k, TAIL_K=tail_k, num_warps=num_warps)
    return out, scale_out
