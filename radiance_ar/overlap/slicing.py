"""The slicing plan: row bounds of M rows cut into S slices, equal or growing.

Row slicing is exact for a row-independent producer (per-token quantization + GEMM):
every slice computes the same rows, bit for bit, as the whole.

Plans (``RADIANCE_AR_OVERLAP_PLAN``):

- ``uniform``: S equal slices. The pipeline's exposed work is one GEMM slice at the head
  and one AR slice at the tail, each 1/S of its lane.
- ``growing``: slice k is 2^k parts of 2^S - 1, so the first slice is 1/(2^S - 1) of M
  and each later one twice the one before. Where one part's AR takes at least twice
  its GEMM (a PCIe box at prefill), the AR lane never waits once it has started: GEMM
  slices 0..k+1 (2^(k+2) - 1 parts) are done by the time AR slices 0..k (2^(k+1) - 1
  parts, begun after the first part's GEMM) are. The only exposed GEMM is then the
  first slice, as small as uniform slicing into 2^S - 1 slices would make it, while
  the AR runs as S calls whose copies stay large. Where the GEMM dominates, the last
  AR slice is exposed instead, and growing slicing makes it large: use ``uniform``.
"""

from __future__ import annotations

from typing import Any

from radiance_ar.envs import OVERLAP_PLANS as PLANS


def slice_count(setting: int | str, backend: Any, rows: int, plan: str,
                world_size: int | None = None) -> int:
    """The S the op runs for ``rows`` rows cut by ``plan``: RADIANCE_AR_OVERLAP_SLICES as
    set, or for ``auto`` the backend's ``preferred_slices_for`` (its slice count chosen
    by measurement, per world size, rows and plan), in ``world_size`` ranks (default: an
    instance's own world; a backend class, as the tools plan cases with, needs it)."""
    if setting != "auto":
        return setting
    size = backend.world.size if world_size is None else world_size
    return backend.preferred_slices_for(size, rows, plan)


def auto_slices_text(backend_cls: Any, world_size: int, min_rows: int, plan: str,
                     max_rows: int = 1 << 16) -> str:
    """What ``auto`` runs in a world of ``world_size`` ranks for calls of ``min_rows`` rows
    or more cut by ``plan``, in words: one count, or each count with the first row count
    that gets it (tried at ``min_rows`` and every power of two above it to ``max_rows``)."""
    firsts: dict[int, int] = {}
    tried = [min_rows] + [1 << e for e in range(min_rows.bit_length(), max_rows.bit_length())]
    for rows in tried:
        firsts.setdefault(backend_cls.preferred_slices_for(world_size, rows, plan), rows)
    if len(firsts) == 1:
        return str(next(iter(firsts)))
    return ", ".join(f"{count} from {rows} rows" for count, rows in firsts.items())


def slice_bounds(rows: int, slices: int, align: int = 1, plan: str = PLANS[0]) -> list[int]:
    """``[b0=0, b1, ..., bS'=rows]``: slice ``s`` covers rows ``b[s]:b[s+1]``.

    Interior bounds are multiples of ``align`` (a GEMM tile or a codec's row group).
    ``uniform``: slice sizes differ by at most one ``align`` unit, and ``S' =
    min(slices, ceil(rows / align))``. ``growing`` (module doc): slice k holds about
    2^k / (2^S' - 1) of the units, with S' the largest count <= ``slices`` for which
    the first slice still holds a unit. No slice is ever empty.
    """
    for name, value in (("rows", rows), ("slices", slices), ("align", align)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"slice_bounds: {name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"slice_bounds: {name} must be >= 1, got {value}")
    if plan not in PLANS:
        raise ValueError(f"slice_bounds: plan {plan!r}: expected one of {', '.join(PLANS)}")
    units = -(-rows // align)
    if plan == PLANS[0]:  # uniform
        count = min(slices, units)
        return [min((i * units // count) * align, rows) for i in range(count + 1)]
    # 2^count - 1 <= units: consecutive bounds then differ by at least one unit
    count = min(slices, (units + 1).bit_length() - 1)
    parts = (1 << count) - 1
    return [min((units * ((1 << i) - 1) // parts) * align, rows) for i in range(count + 1)]


def op_bounds(settings: Any, backend: Any, rows: int, align: int) -> list[int]:
    """The row bounds the op runs for ``rows`` rows: the settings' slice count (or the
    backend's for ``auto``) and plan, at the producer's row alignment."""
    return slice_bounds(rows, slice_count(settings.slices, backend, rows, settings.plan), align,
                        settings.plan)
