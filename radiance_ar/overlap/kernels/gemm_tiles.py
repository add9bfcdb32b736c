"""The MXFP4 GEMM kernels' shared tile work: which output tile a program computes (bands
of GROUP_M row tiles), where its operand tiles start, and one K step's loads.

Programs are numbered along bands of ``GROUP_M`` row tiles, every column tile of a band
before the next band, so the weight tiles a band reads stay in L2 while its row tiles
use them (the grouped ordering of Triton's matmul tutorial)::

    band       = pid // (GROUP_M * tiles_n)
    pid_m      = band * GROUP_M + (pid mod (GROUP_M * tiles_n)) mod rows_in_band
    pid_n      = (pid mod (GROUP_M * tiles_n)) // rows_in_band

Out-of-range rows and columns are clamped for loads (``load_m``, ``load_n``: the last
row or column, read and never stored) so that no load needs a mask.

Operands (both kernels): x [rows, K] one element a value, the packed e2m1 weight
[N, K/2] two values a byte, its e8m0 scales [N, K/32] one byte per 32 values. A kernel
binds these helpers as globals before its first launch (:func:`bind`); Triton inlines them.
"""

from __future__ import annotations

from typing import Any

from radiance_ar.overlap.kernels import lazy_jit

tl: Any = None  # triton.language, bound at the first launch
_jitted: Any = None


def _band_tile(
    pid,  # the program's number
    rows,  # output rows
    N,  # output columns
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # columns per tile
    GROUP_M: tl.constexpr,  # row tiles per band
):
    """(offs_m, offs_n, load_m, load_n): the tile's row and column indices, and the same
    clamped into range as int64 (see the module doc)."""
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    band_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_rows
    pid_n = (pid % band) // band_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    load_m = tl.minimum(offs_m, rows - 1).to(tl.int64)
    load_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    return offs_m, offs_n, load_m, load_n


def _operand_tiles(
    x_ptr, w_ptr, ws_ptr,  # the activation, the packed weight, its scales
    load_m, load_n,  # the tile's clamped rows and columns (_band_tile)
    x_row_stride, w_row_stride, ws_row_stride,  # elements (x) or bytes between rows
    BLOCK_K: tl.constexpr,  # K per step, a multiple of 32
):
    """(offs_k, offs_kb, offs_kg, x_ptrs, w_ptrs, ws_ptrs): the K offsets of a step in
    values, weight bytes and scale groups, and the first step's tiles of the three."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_kg = tl.arange(0, BLOCK_K // 32)
    x_ptrs = x_ptr + load_m[:, None] * x_row_stride + offs_k[None, :]
    w_ptrs = w_ptr + load_n[:, None] * w_row_stride + offs_kb[None, :]
    ws_ptrs = ws_ptr + load_n[:, None] * ws_row_stride + offs_kg[None, :]
    return offs_k, offs_kb, offs_kg, x_ptrs, w_ptrs, ws_ptrs


def _step_tiles(
    x_ptrs, w_ptrs,  # this step's activation and packed-weight tiles
    offs_k, offs_kb,  # the step's K offsets in values and weight bytes
    left,  # K values from this step on
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask
):
    """(x, w): one K step's activation and packed-weight tiles, zeros past K."""
    if EVEN_K:
        x = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
    else:
        x = tl.load(x_ptrs, mask=offs_k[None, :] < left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_kb[None, :] < left // 2, other=0)
    return x, w


def _zero_acc(
    W_LHS: tl.constexpr,  # weight as the left operand: the tile is accumulated as out.T
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # columns per tile
):
    """The fp32 accumulator of one output tile, zeros: [BLOCK_N, BLOCK_M] where the
    weight is the left operand, else [BLOCK_M, BLOCK_N]."""
    if W_LHS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


def _scale_tile(
    ws_ptrs,  # a step's scale tile (_operand_tiles, advanced BLOCK_K / 32 a step)
    offs_kg,  # the step's K offsets in scale groups
    left,  # K values from that step on
    OTHER: tl.constexpr,  # the byte read past K
):
    """One step's e8m0 scales, ``OTHER`` past K. The tile (BLOCK_K / 32 bytes a row) is
    too narrow for the asynchronous copies that pipeline the other loads, so the kernels
    fetch it one step ahead by hand."""
    return tl.load(ws_ptrs, mask=offs_kg[None, :] < left // 32, other=OTHER)


def _e2m1_halves(
    w,  # uint8 tile: two e2m1 codes a byte, the low nibble first in K
):
    """(lo, hi): the low and the high nibble's code as fp16 bits, sign to bit 15 and the
    3 magnitude bits to bits 9-11, so that code c reads as e2m1(c) * 2^-14 (code 1 is
    the fp16 subnormal 2^-15)."""
    lo = ((w & 0x7).to(tl.uint16) << 9) | ((w & 0x8).to(tl.uint16) << 12)
    hi = ((w & 0x70).to(tl.uint16) << 5) | ((w & 0x80).to(tl.uint16) << 8)
    return lo, hi


def _store_tile(
    out_ptr,  # the output rows, unit column stride
    y,  # [BLOCK_M, BLOCK_N] tile in fp32
    offs_m, offs_n,  # the tile's row and column indices (_band_tile)
    rows, N,  # the output's rows and columns
    out_row_stride,  # elements between consecutive rows of out
):
    """Store the in-range part of tile ``y`` in the output's dtype."""
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * out_row_stride + offs_n[None, :]
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


#: what :func:`bind` gives a kernel module
HELPERS = (_band_tile, _operand_tiles, _step_tiles, _zero_acc, _scale_tile, _e2m1_halves,
           _store_tile)


def bind(module_globals: dict[str, Any]) -> None:
    """Bind the jitted :data:`HELPERS` under their names in a kernel module's globals,
    before its kernel's first launch (Triton resolves a kernel's globals when it compiles)."""
    global _jitted
    if _jitted is None:
        _jitted = {fn.__name__: lazy_jit.jit(fn, globals()) for fn in HELPERS}
    module_globals.update(_jitted)
