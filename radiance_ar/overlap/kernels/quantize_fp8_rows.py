"""Per-token fp8 quantization of activations in one pass: amax, scale, cast.

Math, per row m of x [rows, K] (bf16, fp16 or fp32), in fp32 with IEEE rounding::

    scale[m] = max(fl(max_k |x[m, k]|) / 448, 1e-12)      (division rounded to nearest)
    q[m, k]  = e4m3(x[m, k] / scale[m])                    (division rounded to nearest,
                                                            then to nearest e4m3, ties even)

which is bit for bit :func:`radiance_ar.overlap.fp8_activation.quantize_activation`
(torch: ``amax``, ``/ 448``, ``clamp_min(1e-12)``, ``x.float() / scale``, ``.to(e4m3)``);
|x / scale| <= 448 (1 + 2^-23) rounds to 448 at most, so the cast's saturation (Triton)
and overflow to NaN (torch) never differ; a row holding a NaN gets a NaN scale and NaN
codes as in torch.

How, with few instructions a value (on the H200 the earlier form, an IEEE division a
value and a second reduction for NaN, ran at 0.43-0.53 of copy bandwidth at 8192 x 4352
in two runs; this one at 0.78-0.81):

- amax and NaN in one integer max: the bits of |x| (sign cleared) order as the values
  do, and every NaN's bits lie above infinity's, so ``max(bits & ~sign)`` is |x|'s max,
  or a NaN when the row holds one (Triton's float ``max`` drops NaN);
- x / scale as Markstein's sequence: ``y = 1 / scale`` once a row (rounded to nearest),
  then per value ``q = x * y``, ``r = fma(-scale, q, x)``, ``q = fma(r, y, q)``, which is
  the division rounded to nearest (Markstein's theorem: y within half an ulp of 1/scale
  and q within one ulp of x/scale, neither underflowing); x = +-0 keeps its sign (the
  correction adds +0). Checked against torch's division for every finite bf16 x <= amax:
  every third positive bf16 amax on the H200 (355 M divisions), every amax under Triton's
  interpreter (1.07e9, ``tools/results/2026-12-04-cpu-markstein-division/``); no e4m3 code
  differs, nor any fp32 quotient of at least 2^-11 (below, where the residual can
  underflow, every code is a signed zero either way). ``tests/test_mxfp4_fp8_gemm.py``
  checks a spread of amax values end to end. A row whose scale is infinite or NaN takes
  the IEEE division.

Memory: a row is read once (held in registers, as two power-of-two tiles so that little
work is masked) and written once as fp8, plus 4 bytes of scale: 3 bytes a bf16 element,
107 MB at 8192 x 4352. On the H200 that takes 0.034-0.036 ms of device time (launches
replayed from a graph), 0.78-0.81 of a device copy of the same bytes
(``tools/results/2026-12-04-h200-quantize-fp8-rows/``). Rows longer than
:data:`ONE_PASS_MAX_K` are read twice (amax, then cast), the second read mostly from L2.

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
#: the bits of +infinity per input dtype (sign cleared, larger bits are NaN)
INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}
#: rows up to this long are held in registers whole (16384 values, 64 KB as fp32, a row over
#: at most 8 warps); every prefill shape of tools/model_shapes.py (K <= 7168) is one pass
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
    BITS: tl.constexpr,  # tl.int16 or tl.int32: an integer of x's width
    ABS_MASK: tl.constexpr,  # every bit of x but the sign: 0x7FFF or 0x7FFFFFFF
    INF_BITS: tl.constexpr,  # the bits of x's +infinity (any larger |x| bits are NaN)
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
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        amax_bits = _abs_bits_max(x, BITS, ABS_MASK)
        if TAIL_K > 0:
            offs_t = BLOCK_K + tl.arange(0, TAIL_K)
            xt = tl.load(x_row + offs_t, mask=offs_t < K, other=0.0)
            amax_bits = tl.maximum(amax_bits, _abs_bits_max(xt, BITS, ABS_MASK))
    else:
        amax_bits = tl.zeros((), BITS).to(tl.int32)
        for k0 in range(0, K, BLOCK_K):
            part = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax_bits = tl.maximum(amax_bits, _abs_bits_max(part, BITS, ABS_MASK))
    amax = amax_bits.to(BITS).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    amax = tl.where(amax_bits > INF_BITS, float("nan"), amax)
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12, propagate_nan=tl.PropagateNan.ALL)
    tl.store(s_ptr + row, scale)
    fast = scale < float("inf")  # false for an infinite or NaN scale: IEEE division
    y = tl.math.div_rn(1.0, scale)
    if ONE_PASS:
        tl.store(q_row + offs, _codes(x, scale, y, fast, GRID_IN_FP32), mask=offs < K)
        if TAIL_K > 0:
            tl.store(q_row + offs_t, _codes(xt, scale, y, fast, GRID_IN_FP32), mask=offs_t < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            part = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0)
            tl.store(q_row + k0 + offs, _codes(part, scale, y, fast, GRID_IN_FP32),
                     mask=k0 + offs < K)


def _abs_bits_max(x, BITS: tl.constexpr, ABS_MASK: tl.constexpr):
    """max over x of |x|'s bits (sign cleared) as int32: |x|'s max, NaN bits above +inf."""
    return tl.max((x.to(BITS, bitcast=True) & ABS_MASK).to(tl.int32), axis=0)


def _codes(x, scale, y, fast, GRID_IN_FP32: tl.constexpr):
    """e4m3(x / scale): Markstein's sequence with y = 1 / scale (module doc) where
    ``fast``, the IEEE division otherwise."""
    xf = x.to(tl.float32)
    if fast:
        q = xf * y
        q = tl.fma(tl.fma(-scale, q, xf), y, q)
        q = tl.where(xf == 0.0, xf, q)  # -0 / scale is -0; the correction would add +0
    else:
        q = tl.math.div_rn(xf, scale)
    return _e4m3_by_fp32_grid(q) if GRID_IN_FP32 else q.to(tl.float8e4nv)


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
    global _jitted, _e4m3_by_fp32_grid, _abs_bits_max, _codes
    if _jitted is None:
        _e4m3_by_fp32_grid = lazy_jit.jit(_e4m3_by_fp32_grid, globals())
        _abs_bits_max = lazy_jit.jit(_abs_bits_max, globals())
        _codes = lazy_jit.jit(_codes, globals())
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
    # 32 values a thread, 2 to 8 warps: the fastest of 2-16 warps at K = 3584, 4352, 7168
    # and 8192 on the H200, or within 3% (tools/results/2026-12-04-h200-quantize-fp8-rows/)
    num_warps = min(8, max(2, (block_k + tail_k) // 1024))
    kernel = _kernel()
    wide = x.element_size() == 4
    kernel[(rows,)](x, out, scale_out, k, x.stride(0), out.stride(0),
                    BITS=tl.int32 if wide else tl.int16, ABS_MASK=0x7FFFFFFF if wide else 0x7FFF,
                    INF_BITS=INF_BITS[x.dtype], ONE_PASS=one_pass,
                    GRID_IN_FP32=envs.triton_interpreter(), BLOCK_K=block_k, TAIL_K=tail_k,
                    num_warps=num_warps)
    return out, scale_out
