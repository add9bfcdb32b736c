"""The slicing plan: row bounds of M rows cut into S balanced slices.

Row slicing is exact for a row-independent producer (per-token quantization + GEMM):
every slice computes the same rows, bit for bit, as the whole.
"""

from __future__ import annotations

from typing import Any


def slice_count(setting: int | str, backend: Any) -> int:
    """The S the op runs: RADIANCE_AR_OVERLAP_SLICES as set, or for ``auto`` the
    backend's ``preferred_slices`` (its fastest measured slice count)."""
    return backend.preferred_slices if setting == "auto" else setting


def slice_bounds(rows: int, slices: int, align: int = 1) -> list[int]:
    """``[b0=0, b1, ..., bS'=rows]``: slice ``s`` covers rows ``b[s]:b[s+1]``.

    Interior bounds are multiples of ``align`` (a GEMM tile or a codec's row group) and
    slice sizes differ by at most one ``align`` unit. When ``slices`` exceeds the number
    of ``align`` units in ``rows`` the plan is clamped to one slice per unit (so
    ``S' = min(slices, ceil(rows / align))``); no slice is ever empty.
    """
    for name, value in (("rows", rows), ("slices", slices), ("align", align)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"slice_bounds: {name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"slice_bounds: {name} must be >= 1, got {value}")
    units = -(-rows // align)
    count = min(slices, units)
    return [min((i * units // count) * align, rows) for i in range(count + 1)]
