"""MXFP4 W4A8 GEMM on ``tl.dot_scaled``: fp8 activations times microscaled fp4 weights.

Math. For ``rows`` tokens, N output channels and K input channels::

    out[m, n] = round( x_scale[m] * sum_k xq[m, k] * w[n, k] )   (fp32 sum, rounded once)
    w[n, k]   = e2m1(wq[n, k]) * 2^(ws[n, k // 32] - 127)

Formats (OCP Microscaling Formats (MX) v1.0; the float reference and the quantizers
are in :mod:`radiance_ar.overlap.producer_mxfp4`):

- ``xq`` [rows, K]: fp8 e4m3 codes (``torch.float8_e4m3fn``), or the same values
  widened to bf16 (exact), which spares a GPU that emulates the MMA one conversion per
  tile. ``x_scale`` [rows]: fp32, one per token.
- ``wq`` [N, K/2] uint8: e2m1 codes, two per byte along K, element 2j in the low
  nibble. A code is a sign (bit 3) and a magnitude code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- ``ws`` [N, K/32] uint8: e8m0 scales, one per 32 consecutive K values of a row; byte e
  means 2^(e - 127), and 255 is NaN.

Two ways to multiply (``DEQUANT``):

- ``tl.dot_scaled``: one scaled MMA where the GPU has them (MI355 gfx950, Blackwell
  sm_100; the activation gets unit e8m0 scales so that Triton picks the native
  instruction). Elsewhere Triton emulates it (both operands widened to bf16).
- DEQUANT (Hopper): the kernel widens the weight itself, exactly: a code c becomes the
  fp16 bits ``(c & 7) << 9`` (sign to bit 15), which is e2m1(c) * 2^-14, times
  2^(e - 113) in fp32, then bf16 (two significant bits: exact); then one bf16
  ``tl.dot`` with fp32 accumulation. Scale bytes above 240 (2^114 and up) overflow to
  inf on this path; the dot_scaled path covers the whole e8m0 range.

``W_LHS`` chooses the operand order: activation on the left, or weight on the left with
the activation tile transposed on the right, computing ``out.T`` tile by tile (on
Hopper the widened weight then stays in registers as the wgmma register operand and
the bf16 activation tile goes from shared memory straight to the MMA).

Tiles: a program computes one BLOCK_M x BLOCK_N tile of ``out``; programs run in bands
of GROUP_M row tiles so that consecutive programs share weight tiles in L2. Rows past
``rows`` and columns past N are clamped for the loads and masked at the store. K is a
multiple of 32; unless EVEN_K the last K step is masked (zero codes, scale byte 127).

Triton is imported at the first launch, never at module import. ``TRITON_INTERPRET=1``
set before that runs the kernel on CPU tensors (the tests do, in a subprocess).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from radiance_ar import envs
from radiance_ar.overlap.kernels import gemm_tiles, lazy_jit
from radiance_ar.streams import stream_object

MX_GROUP = 32  # K values sharing one e8m0 scale (the MX block size)
E8M0_BIAS, E8M0_NAN = 127, 255  # the scale byte of 2^0, and the byte that means NaN
X_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_X_FORMAT = {torch.float8_e4m3fn: "e4m3", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per tile
    block_n: int  # output channels per tile
    block_k: int  # K per step: a multiple of 32 (one scale per 32 values)
    group_m: int  # row tiles per band of programs (L2 reuse of weight tiles)
    w_lhs: bool  # weight as the left operand (out.T tiles), see the module doc
    dequant: bool  # widen the weight to bf16 in the kernel and tl.dot, see the module doc
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop


#: Launch configs by (GPU class, row class), looked up per launch (no autotuning in the
#: hot path). Only ("emulated", "large") is tuned by timing (see its comment). Each entry
#: compiled offline with Triton 3.9
#: (tools/bench_mxfp4.py --compile-only): sm_90a ("emulated": bf16 activations, weight
#: widened here, wgmma with the weight as register operand, pipelined async copies, no
#: spills and no ptxas C7515 "wgmma serialized" warning), sm_100a ("native": one
#: tcgen05 scaled MMA) and gfx950 (scaled MFMA). ``python tools/bench_mxfp4.py`` times
#: candidates on a GPU; replace an entry only with a measured winner and cite the run.
CONFIGS: dict[tuple[str, str], LaunchConfig] = {
    # tools/bench_mxfp4.py, one H200, Triton 3.6, 8192x5120x4352, 2026-12-03: 339 TFLOP/s,
    # the fastest of 6 (257 for the offline pick 128x128x128 s3):
    # tools/results/2026-12-03-h200-mxfp4/
    ("emulated", "large"): LaunchConfig(256, 128, 64, 8, True, True, 8, 3),
    ("emulated", "medium"): LaunchConfig(64, 128, 128, 8, True, True, 8, 4),
    ("emulated", "small"): LaunchConfig(16, 64, 128, 1, True, True, 4, 4),
    ("native", "large"): LaunchConfig(128, 256, 128, 8, False, False, 8, 3),
    ("native", "medium"): LaunchConfig(128, 128, 128, 8, False, False, 4, 3),
    ("native", "small"): LaunchConfig(16, 128, 128, 1, True, False, 4, 4),
}
#: The activation storage the configs of a GPU class expect: where the MMA is emulated,
#: bf16 (the e4m3 values widened once in ``prepare``) goes straight to the bf16 MMA.
ACTIVATION_DTYPE = {"emulated": torch.bfloat16, "native": torch.float8_e4m3fn}
#: Under the interpreter speed does not matter; one small config exercises the masks.
INTERPRETER_CONFIG = LaunchConfig(32, 32, 64, 2, False, False, 4, 1)
SMALL_ROWS = 64  # at most this many rows: decode-like, a weight-bound launch
MEDIUM_ROWS = 1024


def row_class(rows: int) -> str:
    return "small" if rows <= SMALL_ROWS else "medium" if rows <= MEDIUM_ROWS else "large"


@functools.lru_cache(maxsize=None)
def gpu_class(device: torch.device) -> str:
    """``native`` where the GPU has microscaled MMAs (sm_100, gfx950), else ``emulated``."""
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        native = "gfx950" in props.gcnArchName
    else:
        native = props.major == 10
    return "native" if native else "emulated"


def activation_dtype(device: torch.device) -> torch.dtype:
    """How ``prepare`` stores the e4m3 activation codes for this device's configs."""
    if device.type != "cuda":
        return torch.float8_e4m3fn
    return ACTIVATION_DTYPE[gpu_class(device)]


def launch_config(device: torch.device, rows: int) -> LaunchConfig:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return CONFIGS[(gpu_class(device), row_class(rows))]


tl: Any = None  # triton.language, bound by _kernel() at the first launch
_jitted: Any = None
#: gemm_tiles' helpers (gemm_tiles.HELPERS), bound by _kernel() (gemm_tiles.bind)
_band_tile = _operand_tiles = _step_tiles = _zero_acc = _scale_tile = None
_e2m1_halves = _store_tile = None


def _mxfp4_w4a8_kernel(
    x_ptr,  # *fp8e4nv or *bf16 [rows, K]: activation codes, unit column stride
    xs_ptr,  # *fp32 [rows]: per-token activation scales
    w_ptr,  # *uint8 [N, K/2]: packed e2m1 weight codes, unit column stride
    ws_ptr,  # *uint8 [N, K/32]: e8m0 weight scales, unit column stride
    out_ptr,  # *bf16/fp16/fp32 [rows, N]: the output rows, unit column stride
    rows,  # tokens in this launch
    N,  # output channels
    K,  # input channels, a multiple of 32
    x_row_stride,  # elements between consecutive rows of x
    w_row_stride,  # bytes between consecutive rows of the packed weight
    ws_row_stride,  # bytes between consecutive rows of the scales
    out_row_stride,  # elements between consecutive rows of out
    X_FORMAT: tl.constexpr,  # "e4m3" (fp8 codes) or "bf16" (the same values widened)
    W_LHS: tl.constexpr,  # weight as the left operand: accumulate out.T tiles
    DEQUANT: tl.constexpr,  # widen the weight to bf16 here and tl.dot (else tl.dot_scaled)
    DOT_FP32: tl.constexpr,  # DEQUANT's tl.dot in fp32 (the interpreter's bf16 dot is wrong)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask in the K loop
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # output channels per tile
    BLOCK_K: tl.constexpr,  # K per step, a multiple of 32
    GROUP_M: tl.constexpr,  # row tiles per band of programs
):
    offs_m, offs_n, load_m, load_n = _band_tile(tl.program_id(0), rows, N, BLOCK_M, BLOCK_N,
                                                GROUP_M)
    offs_k, offs_kb, offs_kg, x_ptrs, w_ptrs, ws_ptrs = _operand_tiles(
        x_ptr, w_ptr, ws_ptr, load_m, load_n, x_row_stride, w_row_stride, ws_row_stride,
        BLOCK_K)
    acc = _zero_acc(W_LHS, BLOCK_M, BLOCK_N)
    ws_next = _scale_tile(ws_ptrs, offs_kg, K, 127)  # one step ahead (_scale_tile)
    for k0 in range(0, K, BLOCK_K):
        ws = ws_next
        ws_ptrs += BLOCK_K // 32
        ws_next = _scale_tile(ws_ptrs, offs_kg, K - k0 - BLOCK_K, 127)
        x, w = _step_tiles(x_ptrs, w_ptrs, offs_k, offs_kb, K - k0, EVEN_K)
        if DEQUANT:
            lo, hi = _e2m1_halves(w)  # exact widening (module doc)
            codes = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)
            small = codes.to(tl.float16, bitcast=True).to(tl.float32)
            scale_bits = tl.minimum(ws.to(tl.uint32) + 14, 255) << 23
            scale = tl.where(ws == 255, float("nan"), scale_bits.to(tl.float32, bitcast=True))
            wv = (small.reshape(BLOCK_N, BLOCK_K // 32, 32) * scale[:, :, None])
            if DOT_FP32:
                wv = wv.reshape(BLOCK_N, BLOCK_K)
                xv = x.to(tl.float32)
            else:
                wv = wv.reshape(BLOCK_N, BLOCK_K).to(tl.bfloat16)
                xv = x.to(tl.bfloat16)
            if W_LHS:
                acc = tl.dot(wv, tl.trans(xv), acc)
            else:
                acc = tl.dot(xv, tl.trans(wv), acc)
        elif X_FORMAT == "e4m3":
            # Unit e8m0 scales (127) for the activation: with None, Triton 3.9 lowered the
            # mixed e4m3 x e2m1 product for sm_100 to a bf16 MMA (checked by compiling
            # offline); with scales it is the native scaled MMA.
            unit = tl.full((BLOCK_M, BLOCK_K // 32), 127, tl.uint8)
            if W_LHS:
                acc = tl.dot_scaled(w, ws, "e2m1", tl.trans(x), unit, "e4m3", acc)
            else:
                acc = tl.dot_scaled(x, unit, "e4m3", tl.trans(w), ws, "e2m1", acc)
        elif W_LHS:
            acc = tl.dot_scaled(w, ws, "e2m1", tl.trans(x), None, "bf16", acc)
        else:
            acc = tl.dot_scaled(x, None, "bf16", tl.trans(w), ws, "e2m1", acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2

    xs = tl.load(xs_ptr + load_m)
    if W_LHS:
        y = tl.trans(acc * xs[None, :])
    else:
        y = acc * xs[:, None]
    _store_tile(out_ptr, y, offs_m, offs_n, rows, N, out_row_stride)


def _kernel() -> Any:
    """The jitted kernel, Triton imported here. ``rows`` is not specialized on, so the
    slices of one call (and calls of other M) share one compiled variant."""
    global _jitted
    if _jitted is None:
        gemm_tiles.bind(globals())
        _jitted = lazy_jit.jit(_mxfp4_w4a8_kernel, globals(), do_not_specialize=["rows"])
    return _jitted


def _check(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
           out: torch.Tensor | None) -> None:
    named = [("x", x), ("x_scale", x_scale), ("w", w), ("w_scale", w_scale)]
    if out is not None:
        named.append(("out", out))
    for label, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mxfp4_w4a8: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"mxfp4_w4a8: {label} is on {t.device}, x on {x.device}")
    if x.device.type != "cuda" and not envs.triton_interpreter():
        raise ValueError(f"mxfp4_w4a8: x is on {x.device}; the kernel runs on CUDA/ROCm GPUs "
                         "(or on the CPU under Triton's interpreter, TRITON_INTERPRET=1)")
    if x.dim() != 2 or x.dtype not in X_DTYPES or x.stride(1) != 1:
        raise ValueError(f"mxfp4_w4a8: x must be 2-D {' or '.join(map(str, X_DTYPES))} with "
                         f"unit column stride, got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    rows, k = x.shape
    if k == 0 or k % MX_GROUP:
        raise ValueError(f"mxfp4_w4a8: K = {k} (x columns) must be a positive multiple of "
                         f"{MX_GROUP}, the MX scale block")
    if x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (rows,) \
            or not x_scale.is_contiguous():
        raise ValueError(f"mxfp4_w4a8: x_scale must be contiguous float32 of shape ({rows},), "
                         f"got {tuple(x_scale.shape)} {x_scale.dtype}")
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != k // 2 or w.stride(1) != 1:
        raise ValueError(f"mxfp4_w4a8: w must be packed e2m1 uint8 of shape (N, {k // 2}) "
                         f"(two codes per byte along K = {k}) with unit column stride, got "
                         f"{tuple(w.shape)} {w.dtype} strides {w.stride()}")
    n = w.shape[0]
    if w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != (n, k // MX_GROUP) \
            or w_scale.stride(1) != 1:
        raise ValueError(f"mxfp4_w4a8: w_scale must be e8m0 uint8 of shape ({n}, "
                         f"{k // MX_GROUP}) with unit column stride, got "
                         f"{tuple(w_scale.shape)} {w_scale.dtype} strides {w_scale.stride()}")
    if out is not None and (out.dtype not in OUT_DTYPES or tuple(out.shape) != (rows, n)
                            or out.stride(1) != 1):
        raise ValueError(f"mxfp4_w4a8: out must be ({rows}, {n}) of one of {OUT_DTYPES} with "
                         f"unit column stride, got {tuple(out.shape)} {out.dtype} "
                         f"strides {out.stride()}")


_external_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


@contextlib.contextmanager
def _on_stream(device: torch.device, stream: int | None) -> Iterator[None]:
    """Make ``device`` and ``stream`` (a raw cudaStream_t/hipStream_t on it) current:
    Triton launches on the current device's current stream."""
    if device.type != "cuda":
        yield
        return
    with contextlib.ExitStack() as stack:
        if device.index != torch.cuda.current_device():
            stack.enter_context(torch.cuda.device(device))
        if stream is not None and stream != torch.cuda.current_stream(device).cuda_stream:
            key = (device, stream)
            if key not in _external_streams:
                _external_streams[key] = stream_object(stream, device)
            stack.enter_context(torch.cuda.stream(_external_streams[key]))
        yield


def mxfp4_w4a8_gemm(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                    w_scale: torch.Tensor, out: torch.Tensor | None = None,
                    stream: int | None = None, config: LaunchConfig | None = None) -> torch.Tensor:
    """``out = x_scale[:, None] * (xq @ dequant(w, w_scale).T)`` (module doc); checks,
    allocates ``out`` (bf16) when not given, launches on ``stream`` (a raw handle;
    default the current stream) with ``config`` (default: :func:`launch_config`)."""
    _check(x, x_scale, w, w_scale, out)
    rows, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
    if rows == 0 or n == 0:
        return out
    cfg = config if config is not None else launch_config(x.device, rows)
    if cfg.block_k % MX_GROUP:
        raise ValueError(f"mxfp4_w4a8: config block_k {cfg.block_k} must be a multiple of "
                         f"{MX_GROUP}")
    kernel = _kernel()
    grid = (-(-rows // cfg.block_m) * -(-n // cfg.block_n),)
    with _on_stream(x.device, stream):
        kernel[grid](
            x, x_scale, w, w_scale, out, rows, n, k,
            x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
            X_FORMAT=_X_FORMAT[x.dtype], W_LHS=cfg.w_lhs, DEQUANT=cfg.dequant,
            DOT_FP32=envs.triton_interpreter(), EVEN_K=k % cfg.block_k == 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
