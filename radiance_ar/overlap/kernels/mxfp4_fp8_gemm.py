"""MXFP4 W4A8 GEMM on fp8 tensor cores: the e2m1 weight widened to e4m3 in the kernel.

Math. For ``rows`` tokens, N output channels and K input channels (formats as in
:mod:`radiance_ar.overlap.kernels.mxfp4_w4a8`: e4m3 activation codes ``xq`` with a
per-token fp32 scale, packed e2m1 codes ``wq`` with one e8m0 byte ``ws`` per 32 K)::

    w[n, k]   = e2m1(wq[n, k]) * 2^(ws[n, k // 32] - 127)
              = 2^t[n] * v[n, k],   v[n, k] = e2m1(wq[n, k]) * 2^E,   E = ws - 127 - t[n]
    out[m, n] = round( x_scale[m] * 2^t[n] * sum_k xq[m, k] * v[n, k] )

with one power-of-two shift t[n] per output channel (:func:`plan_columns`, once per
weight). ``v`` is an e4m3 value, exactly, whenever E is in [-8, 6]: e2m1's nonzero
magnitudes are 2^-1, 2^0, 1.5 * 2^0, 2^1, 1.5 * 2^1, 2^2, 1.5 * 2^2, so times 2^E they
need 2^(E - 1) >= 2^-9 (e4m3's least subnormal), 1.5 * 2^E a multiple of 2^-9 (E >= -8)
and 1.5 * 2^(E + 2) <= 448 (E <= 6). t[n] puts the column's largest scale of a block
holding a nonzero code at E = 6; the column is exact when its other such blocks lie
within 14 binades (E >= -8). A weight with a column spread wider than that, or a NaN
scale (byte 255), is not for this kernel (``ColumnPlan.fits`` False, with the reason):
the producer runs the bf16-widening kernel for it. Blocks of zero codes are exact at any
E (the kernel clamps E into [-8, 6] so their factor stays finite).

Widening, per element, all exact, two ways (``LaunchConfig.widen_asm``):

- inline PTX (CUDA sm_89+, :data:`_WIDEN_PTX_TEXT`): the e4m3 bits of e2m1(c) * 2^-6 are
  ``((c & 7) << 2) | ((c & 8) << 4)`` (code 1 the e4m3 subnormal 2^-7), built for 8
  codes with a few 32-bit operations; e4m3 -> f16, times the block's f16 factor
  2^(E + 6) (in [2^-2, 2^12]) gives e2m1(c) * 2^E in [2^-9, 384], f16 normals; -> e4m3.
- Triton ops (ROCm; the interpreter, which runs no PTX): a code c becomes the fp16 bits
  ``(c & 7) << 9`` (sign to bit 15), e2m1(c) * 2^-14 (code 1 the fp16 subnormal 2^-15);
  times the same factor it is e2m1(c) * 2^(E - 8), at least 2^-17, an fp16 value; times
  256, then cast to e4m3.

Then one fp8 ``tl.dot`` with fp32 accumulation; the epilogue multiplies by x_scale[m],
then by 2^t[n] (exact unless the result over- or underflows; 2^t itself may be an fp32
subnormal, hence last).

Bits and error. Products of e4m3 values are exact in fp32. With IEEE fp32 summation
(the interpreter, where the bound is tested) the result against the float64 product of
the dequantized operands ``y`` is bounded by::

    |out - y| <= 2^-8 |y| + (K + 2) * 2^-24 * sum_k |x[m, k] w[n, k]|     (bf16 out)

(2^-8: the output rounding to bf16 plus the fp32 scale product; (K + 2) 2^-24: the
recursive fp32 sum of K exact products and the two scale products), plus half the
output's least subnormal where the result is subnormal. Hopper's fp8 MMA adds inside
its instructions with fewer bits than fp32 (DeepSeek-V3 report: about 14): with
``promote_k`` Triton adds each ``promote_k`` products' partial sum into an fp32
accumulator, so only those short sums are the MMA's, and on the GPU the bound gains a
term for them::

    + 2^-10 * sum_k |x[m, k] w[n, k]|

(measured on the H200, 2026-12-04, docs/history.md: a channel whose first block holds
every code at the top of e4m3's range lost 2^-11.8 of its first 128 products' magnitude; the GPU tests
hold promoted configs to this bound, at the range edges too, and to 1.7e-3 relative RMS
on random data). With 0 the whole sum is the MMA's, measured (tools/tune_mxfp4_fp8.py)
rather than bounded. The cuBLAS route (:mod:`radiance_ar.overlap.mxfp4_routes`) met the
fp32 bound alone on the same channel.

Tiles, bands (GROUP_M) and operand order (W_LHS) as in ``mxfp4_w4a8``; K is a multiple
of 32 and, unless EVEN_K, the last K step is masked. Triton is imported at the first
launch; ``TRITON_INTERPRET=1`` set before that runs the kernel on CPU tensors.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from radiance_ar import envs
from radiance_ar.overlap.kernels import gemm_tiles, lazy_jit
from radiance_ar.overlap.kernels import mxfp4_w4a8 as bf16_kernel

MX_GROUP, E8M0_BIAS, E8M0_NAN = bf16_kernel.MX_GROUP, bf16_kernel.E8M0_BIAS, bf16_kernel.E8M0_NAN
E_MAX, E_MIN = 6, -8  # the block exponents E for which every e2m1 value times 2^E is e4m3
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per tile
    block_n: int  # output channels per tile
    block_k: int  # K per step: a multiple of 32
    group_m: int  # row tiles per band of programs (L2 reuse of weight tiles)
    w_lhs: bool  # weight as the left (register) operand: accumulate out.T tiles
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop
    promote_k: int  # products per fp32 partial-sum add (Triton's max_num_imprecise_acc,
    #                 <= block_k, a multiple of 32); 0: the MMA's own accumulation. w_lhs
    #                 configs must say 0: Triton 3.9 drops the attribute on the
    #                 register-operand path (its TTGIR for sm_90 keeps the default 2^30)
    widen_asm: bool = False  # widen by inline PTX (_WIDEN_PTX: CUDA sm_89+; under the
    #                          interpreter, which runs no PTX, the Triton-op widening)


#: shapes not in CONFIGS, M >= LARGE_ROWS: the tile the tune's table uses at most shapes,
#: the weight widened in PTX, the fp32 partial sum promoted every 128 products (fp32
#: summation's bound). ptxas (Triton 3.9, offline: ``python tools/bench_mxfp4.py
#: --compile-only --arch 90``, which reports every config below): 255 registers, 16 bytes
#: spilled, 128 KB shared.
DEFAULT_CONFIG = LaunchConfig(256, 128, 128, 8, False, 8, 3, 128, True)
#: Configs by (N, K) of a rank's o_proj / down_proj (tools/model_shapes.py: Llama-3.1-8B
#: TP 2, Llama-3.1-70B TP 4, Qwen3-32B TP 4, and the bench's 5120 x 4352), for
#: M >= LARGE_ROWS, as tools/tune_mxfp4_fp8.py printed them on the H200 run of
#: 2026-12-04, 14:58 UTC (tools/results/2026-12-04-h200-mxfp4-fp8/tune_mxfp4_fp8.json, with
#: the 4-stage candidates); the MMA's own accumulation (promote_k 0) met the error bound at
#: K = 2048 only. Measured on Hopper: other fp8-MMA GPUs have less shared memory.
CONFIGS: dict[tuple[int, int], LaunchConfig] = {
    # tools/tune_mxfp4_fp8.py, NVIDIA H200, Triton 3.6.0, 2026-12-04: the fastest of 8
    # candidates (geometric mean TFLOP/s over M = 2048, 8192, 16384) within the error
    # bound, max(0.0017, 1.05 x the bf16 rounding of the exact product), relative RMS
    (4096, 2048): LaunchConfig(256, 128, 128, 8, False, 8, 3, 0, True),  # 585 TFLOP/s
    (4096, 7168): LaunchConfig(256, 128, 128, 8, False, 8, 4, 128, True),  # 685 TFLOP/s
    (5120, 2048): LaunchConfig(256, 128, 128, 8, False, 8, 3, 0, True),  # 583 TFLOP/s
    (5120, 4352): LaunchConfig(256, 128, 128, 8, False, 8, 4, 128, True),  # 642 TFLOP/s
    (5120, 6400): LaunchConfig(256, 128, 128, 8, False, 8, 4, 128, True),  # 675 TFLOP/s
    (8192, 2048): LaunchConfig(256, 128, 128, 8, False, 8, 3, 0, True),  # 640 TFLOP/s
    (8192, 7168): LaunchConfig(256, 128, 128, 8, False, 8, 4, 128, True),  # 700 TFLOP/s
}
#: fewer rows: smaller row tiles keep the SMs busy
MEDIUM_CONFIG = LaunchConfig(64, 128, 128, 8, False, 4, 4, 128, True)  # 202 registers, no spill
LARGE_ROWS = 1024
#: Under the interpreter speed does not matter; one small config exercises the masks.
INTERPRETER_CONFIG = LaunchConfig(32, 32, 64, 2, False, 4, 1, 64)


def launch_config(device: torch.device, rows: int, n: int, k: int) -> LaunchConfig:
    """The table's config; on ROCm (no PTX) the same tile widened in Triton ops."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    cfg = MEDIUM_CONFIG if rows < LARGE_ROWS else CONFIGS.get((n, k), DEFAULT_CONFIG)
    return dataclasses.replace(cfg, widen_asm=False) if torch.version.hip else cfg


@functools.lru_cache(maxsize=None)  # asked by every MXFP4 op call's prepare
def has_fp8_mma(device: torch.device) -> bool:
    """fp8 (OCP e4m3) tensor-core MMA without microscaled MMA: CUDA sm_89 (Ada) and sm_90
    (Hopper), and sm_12x; AMD RDNA4 (gfx12). Blackwell sm_100 and MI355 (gfx950) have the
    scaled MMA that ``mxfp4_w4a8``'s native path uses; MI300 (gfx942) has fp8 in the FNUZ
    encoding only, and pre-Ada NVIDIA and RDNA3 have no fp8 MMA: those keep the
    bf16-widening kernel."""
    if device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return props.gcnArchName.startswith("gfx12")
    return (props.major, props.minor) >= (8, 9) and props.major != 10


@dataclass(frozen=True)
class ColumnPlan:
    """The per-output-channel shift of one weight (module doc)."""
    top: torch.Tensor  # int32 [N]: the scale byte mapped to E = 6 (largest used block)
    col_scale: torch.Tensor  # fp32 [N]: 2^t = 2^(top - 127 - 6), applied in the epilogue
    reason: str  # why the weight does not fit, "" when it does

    @property
    def fits(self) -> bool:
        """Every used block within 14 binades of its column's top, no NaN scale."""
        return not self.reason


def check_weight(packed: torch.Tensor, scales: torch.Tensor, who: str) -> None:
    """Raise ``ValueError`` (naming ``who``) unless ``packed`` and ``scales`` are an MXFP4
    weight: uint8 codes [N, K/2] and uint8 e8m0 scales [N, K/32], K a multiple of 32."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.dim() != 2 \
            or tuple(scales.shape) != (packed.shape[0], 2 * packed.shape[1] // MX_GROUP) \
            or (2 * packed.shape[1]) % MX_GROUP:
        raise ValueError(f"{who}: expected uint8 codes (N, K/2) and uint8 scales "
                         f"(N, K/32) with K a multiple of {MX_GROUP}, got "
                         f"{tuple(packed.shape)} {packed.dtype} and {tuple(scales.shape)} "
                         f"{scales.dtype}")


def column_range(packed: torch.Tensor, scales: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(top, spread), int32 [N] each: per output channel the largest scale byte of a block
    holding a nonzero code (E8M0_BIAS + E_MAX where there is none) and how far below it
    the smallest such block lies (0 for an all-zero channel); it fits when spread <= 14."""
    check_weight(packed, scales, "column_range")
    n = packed.shape[0]
    used = (packed.reshape(n, -1, MX_GROUP // 2) & 0x77).amax(dim=2) > 0  # a nonzero code
    s = scales.to(torch.int32)
    top = torch.where(used, s, -1).amax(dim=1)
    low = torch.where(used, s, 256).amin(dim=1)
    empty = top < 0
    top = torch.where(empty, E8M0_BIAS + E_MAX, top)  # an all-zero column: t = 0
    return top.to(torch.int32), torch.where(empty, 0, top - low).to(torch.int32)


def plan_columns(packed: torch.Tensor, scales: torch.Tensor) -> ColumnPlan:
    """The shifts for packed e2m1 codes [N, K/2] and e8m0 scales [N, K/32] (a host sync:
    call it once per weight, at load)."""
    top, spread = column_range(packed, scales)  # checks the weight
    worst = int(spread.max()) if spread.numel() else 0
    nan = bool((scales == E8M0_NAN).any())
    reason = ("a scale byte is 255 (NaN)" if nan else
              f"a column's blocks span {worst + 1} binades, more than the "
              f"{E_MAX - E_MIN + 1} e4m3 holds" if worst > E_MAX - E_MIN else "")
    col_scale = torch.pow(2.0, (top - E8M0_BIAS - E_MAX).double()).float()
    return ColumnPlan(top.contiguous(), col_scale.contiguous(), reason)


#: The widening in PTX (module doc), 4 packed bytes (8 codes) a call: $0 gets the e4m3 of
#: the 4 low nibbles (row elements 0, 2, 4, 6), $1 of the high ones; $3 and $4 hold the f16
#: factors of bytes 0-1 and 2-3 (equal: one block). The widening in Triton ops was the
#: tune's slowest candidate at 8192 x 5120 x 4352 (367 TFLOP/s against 570-714 for the PTX
#: widening's; tools/results/2026-12-04-h200-mxfp4-fp8/tune_mxfp4_fp8.json, other tiles).
_WIDEN_PTX_TEXT = """{
.reg .b32 l, h, t, f0, f1, f2, f3;
.reg .b16 l0, l1, h0, h1, o0, o1, o2, o3;
and.b32 l, $2, 0x07070707;
shl.b32 l, l, 2;
and.b32 t, $2, 0x08080808;
shl.b32 t, t, 4;
or.b32 l, l, t;
shr.u32 h, $2, 2;
and.b32 h, h, 0x1C1C1C1C;
and.b32 t, $2, 0x80808080;
or.b32 h, h, t;
mov.b32 {l0, l1}, l;
mov.b32 {h0, h1}, h;
cvt.rn.f16x2.e4m3x2 f0, l0;
cvt.rn.f16x2.e4m3x2 f1, l1;
cvt.rn.f16x2.e4m3x2 f2, h0;
cvt.rn.f16x2.e4m3x2 f3, h1;
mul.rn.f16x2 f0, f0, $3;
mul.rn.f16x2 f1, f1, $4;
mul.rn.f16x2 f2, f2, $3;
mul.rn.f16x2 f3, f3, $4;
cvt.rn.satfinite.e4m3x2.f16x2 o0, f0;
cvt.rn.satfinite.e4m3x2.f16x2 o1, f1;
cvt.rn.satfinite.e4m3x2.f16x2 o2, f2;
cvt.rn.satfinite.e4m3x2.f16x2 o3, f3;
mov.b32 $0, {o0, o1};
mov.b32 $1, {o2, o3};
}"""

_WIDEN_PTX: Any = None  # _WIDEN_PTX_TEXT as a tl.constexpr, bound by _kernel()
tl: Any = None  # triton.language, bound by _kernel() at the first launch
_jitted: Any = None
#: gemm_tiles' helpers (gemm_tiles.HELPERS), bound by _kernel() (gemm_tiles.bind)
_band_tile = _operand_tiles = _step_tiles = _zero_acc = _scale_tile = None
_e2m1_halves = _store_tile = None


def _mxfp4_fp8_gemm_kernel(
    x_ptr,  # *fp8e4nv [rows, K]: activation codes, unit column stride
    xs_ptr,  # *fp32 [rows]: per-token activation scales
    w_ptr,  # *uint8 [N, K/2]: packed e2m1 weight codes, unit column stride
    ws_ptr,  # *uint8 [N, K/32]: e8m0 weight scales, unit column stride
    top_ptr,  # *int32 [N]: ColumnPlan.top, the scale byte widened to E = 6
    cs_ptr,  # *fp32 [N]: ColumnPlan.col_scale, 2^t per column
    out_ptr,  # *bf16/fp16/fp32 [rows, N]: the output rows, unit column stride
    rows,  # tokens in this launch
    N,  # output channels
    K,  # input channels, a multiple of 32
    x_row_stride,  # elements between consecutive rows of x
    w_row_stride,  # bytes between consecutive rows of the packed weight
    ws_row_stride,  # bytes between consecutive rows of the scales
    out_row_stride,  # elements between consecutive rows of out
    W_LHS: tl.constexpr,  # weight as the left operand: accumulate out.T tiles
    PROMOTE_K: tl.constexpr,  # Triton's max_num_imprecise_acc (None: the MMA's own)
    DOT_FP32: tl.constexpr,  # the dot in fp32 (the interpreter has no fp8 dot)
    WIDEN_ASM: tl.constexpr,  # widen by _WIDEN_PTX (CUDA sm_89+), else in Triton ops
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
    top = tl.load(top_ptr + load_n)
    acc = _zero_acc(W_LHS, BLOCK_M, BLOCK_N)
    ws_next = _scale_tile(ws_ptrs, offs_kg, K, 0)  # one step ahead (_scale_tile)
    for k0 in range(0, K, BLOCK_K):
        ws = ws_next
        ws_ptrs += BLOCK_K // 32
        ws_next = _scale_tile(ws_ptrs, offs_kg, K - k0 - BLOCK_K, 0)
        x, w = _step_tiles(x_ptrs, w_ptrs, offs_k, offs_kb, K - k0, EVEN_K)
        # E - 6 = ws - top, clamped to [E_MIN - E_MAX, 0] = [-14, 0]; the factor
        # 2^(E + 6) has the fp16 exponent field E + 6 + 15 = (E - 6) + 27 in [13, 27].
        e = tl.minimum(tl.maximum(ws.to(tl.int32) - top[:, None], -14), 0)
        factor = ((e + 27) << 10).to(tl.uint16).to(tl.float16, bitcast=True)
        if WIDEN_ASM:
            f = tl.broadcast_to(factor[:, :, None], (BLOCK_N, BLOCK_K // 32, 16))
            lo, hi = tl.inline_asm_elementwise(
                _WIDEN_PTX, "=r,=r,r,r,r", [w, f.reshape(BLOCK_N, BLOCK_K // 2)],
                dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)
            w8 = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)
        else:
            lo, hi = _e2m1_halves(w)  # e2m1(c) * 2^-14 as fp16 bits (module doc)
            small = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K).to(tl.float16, bitcast=True)
            v = small.reshape(BLOCK_N, BLOCK_K // 32, 32) * factor[:, :, None]
            v = v.reshape(BLOCK_N, BLOCK_K) * tl.full((), 256.0, tl.float16)
            w8 = v.to(tl.float8e4nv)
        if DOT_FP32:
            wv, xv = w8.to(tl.float32), x.to(tl.float32)
            if W_LHS:
                acc = tl.dot(wv, tl.trans(xv), acc, input_precision="ieee")
            else:
                acc = tl.dot(xv, tl.trans(wv), acc, input_precision="ieee")
        elif W_LHS:
            acc = tl.dot(w8, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE_K)
        else:
            acc = tl.dot(x, tl.trans(w8), acc, max_num_imprecise_acc=PROMOTE_K)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2

    xs = tl.load(xs_ptr + load_m)
    cs = tl.load(cs_ptr + load_n)
    # acc * x_scale first: 2^t may be an fp32 subnormal (top < 7), which an intermediate
    # product must not round through; times 2^t last is exact unless the result is.
    if W_LHS:
        y = tl.trans(acc * xs[None, :] * cs[:, None])
    else:
        y = acc * xs[:, None] * cs[None, :]
    _store_tile(out_ptr, y, offs_m, offs_n, rows, N, out_row_stride)


def _kernel() -> Any:
    """The jitted kernel, Triton imported here; ``rows`` is not specialized on."""
    global _jitted, _WIDEN_PTX
    if _jitted is None:
        gemm_tiles.bind(globals())
        _jitted = lazy_jit.jit(_mxfp4_fp8_gemm_kernel, globals(), do_not_specialize=["rows"])
        _WIDEN_PTX = tl.constexpr(_WIDEN_PTX_TEXT)  # Triton reads only constexpr globals
    return _jitted


def _check_plan(plan: ColumnPlan, n: int, device: torch.device) -> None:
    if not isinstance(plan, ColumnPlan):
        raise TypeError(f"mxfp4_fp8_gemm: plan must be a ColumnPlan (plan_columns), got "
                        f"{type(plan).__name__}")
    if not plan.fits:
        raise ValueError(f"mxfp4_fp8_gemm: this weight is not exact in e4m3 ({plan.reason}); "
                         "run mxfp4_w4a8_gemm (bf16 widening) for it")
    for label, t, dtype in (("top", plan.top, torch.int32), ("col_scale", plan.col_scale,
                                                              torch.float32)):
        if t.dtype != dtype or tuple(t.shape) != (n,) or t.device != device \
                or not t.is_contiguous():
            raise ValueError(f"mxfp4_fp8_gemm: plan.{label} must be contiguous {dtype} of "
                             f"shape ({n},) on {device} (the plan of this weight), got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


def mxfp4_fp8_gemm(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                   w_scale: torch.Tensor, plan: ColumnPlan, out: torch.Tensor | None = None,
                   stream: int | None = None, config: LaunchConfig | None = None,
                   ) -> torch.Tensor:
    """``out = x_scale[:, None] * (xq @ dequant(w, w_scale).T)`` on fp8 MMA (module doc);
    checks, allocates ``out`` (bf16) when not given, launches on ``stream`` (a raw handle;
    default the current stream) with ``config`` (default: :func:`launch_config`)."""
    bf16_kernel._check(x, x_scale, w, w_scale, out)
    if x.dtype != FP8:
        raise ValueError(f"mxfp4_fp8_gemm: x must be {FP8} codes, got {x.dtype}")
    rows, k = x.shape
    n = w.shape[0]
    _check_plan(plan, n, x.device)
    if out is None:
        out = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
    if rows == 0 or n == 0:
        return out
    cfg = config if config is not None else launch_config(x.device, rows, n, k)
    if cfg.widen_asm and torch.version.hip:
        raise ValueError(f"mxfp4_fp8_gemm: config {cfg}: widen_asm is CUDA PTX; on ROCm "
                         "use widen_asm=False")
    if cfg.block_k % MX_GROUP or cfg.promote_k % 32 or cfg.promote_k > cfg.block_k \
            or (cfg.w_lhs and cfg.promote_k):
        raise ValueError(f"mxfp4_fp8_gemm: config {cfg}: block_k must be a multiple of "
                         f"{MX_GROUP}, promote_k a multiple of 32 no larger than block_k, "
                         "and 0 for w_lhs (see LaunchConfig)")
    grid = (-(-rows // cfg.block_m) * -(-n // cfg.block_n),)
    with bf16_kernel._on_stream(x.device, stream):
        _kernel()[grid](
            x, x_scale, w, w_scale, plan.top, plan.col_scale, out, rows, n, k,
            x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
            W_LHS=cfg.w_lhs, PROMOTE_K=cfg.promote_k or None,
            WIDEN_ASM=cfg.widen_asm and not envs.triton_interpreter(),
            DOT_FP32=envs.triton_interpreter(), EVEN_K=k % cfg.block_k == 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
