"""Which output tile a GEMM program computes: bands of GROUP_M row tiles (the MXFP4 kernels').

Programs are numbered along bands of ``GROUP_M`` row tiles, every column tile of a band
before the next band, so the weight tiles a band reads stay in L2 while its row tiles
use them (the grouped ordering of Triton's matmul tutorial)::

    band       = pid // (GROUP_M * tiles_n)
    pid_m      = band * GROUP_M + (pid mod (GROUP_M * tiles_n)) mod rows_in_band
    pid_n      = (pid mod (GROUP_M * tiles_n)) // rows_in_band

Out-of-range rows and columns are clamped for loads (``load_m``, ``load_n``: the last
row or column, read and never stored) so that no load needs a mask.
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


def band_tile() -> Any:
    """The jitted helper, for a kernel module to bind as its global ``_band_tile`` before
    its kernel's first launch (Triton resolves a kernel's globals when it compiles)."""
    global _jitted
    if _jitted is None:
        _jitted = lazy_jit.jit(_band_tile, globals())
    return _jitted
