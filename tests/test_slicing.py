"""Slice bounds cover every row exactly once, balanced, aligned, never empty."""

import pytest

from radiance_ar.overlap.slicing import slice_bounds


@pytest.mark.parametrize("align", [1, 2, 16, 64])
def test_bounds_partition_rows(align):
    for rows in list(range(1, 70)) + [1000, 2048, 8191, 8192, 16384]:
        for slices in (1, 2, 3, 4, 7, 8, 64, 200):
            b = slice_bounds(rows, slices, align)
            covered = [r for s in range(len(b) - 1) for r in range(b[s], b[s + 1])]
            assert covered == list(range(rows)), (rows, slices, align)
            sizes = [b[s + 1] - b[s] for s in range(len(b) - 1)]
            assert min(sizes) >= 1
            assert all(x % align == 0 for x in b[1:-1])
            units = -(-rows // align)
            assert len(sizes) == min(slices, units)
            # balanced: full slices differ by at most one alignment unit
            assert max(sizes[:-1] or sizes) - min(sizes[:-1] or sizes) <= align


def test_more_slices_than_rows_is_clamped():
    assert slice_bounds(3, 8) == [0, 1, 2, 3]
    assert slice_bounds(1, 4) == [0, 1]


def test_exact_example():
    assert slice_bounds(8192, 4) == [0, 2048, 4096, 6144, 8192]
    assert slice_bounds(100, 3, align=16) == [0, 32, 64, 100]


@pytest.mark.parametrize("args", [(0, 4), (5, 0), (5, 2, 0), (-1, 2)])
def test_non_positive_arguments_raise(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        slice_bounds(*args)


def test_non_int_raises():
    with pytest.raises(TypeError, match="rows must be an int"):
        slice_bounds(5.0, 2)


@pytest.mark.parametrize("align", [1, 2, 16, 64])
def test_growing_bounds_partition_rows_and_double(align):
    """Each growing slice holds twice the units of the one before, up to the rounding
    of one unit, the first 1/(2^S' - 1) of them; S' is clamped so no slice is empty."""
    for rows in list(range(1, 70)) + [1000, 2048, 8191, 8192, 16384]:
        for slices in (1, 2, 3, 4, 7, 8, 64):
            b = slice_bounds(rows, slices, align, "growing")
            covered = [r for s in range(len(b) - 1) for r in range(b[s], b[s + 1])]
            assert covered == list(range(rows)), (rows, slices, align)
            assert all(x % align == 0 for x in b[1:-1])
            units = -(-rows // align)
            count = len(b) - 1
            assert count == min(slices, max(c for c in range(1, 64) if 2 ** c - 1 <= units))
            sizes = [-(-(b[s + 1] - b[s]) // align) for s in range(count)]  # in units
            assert min(sizes) >= 1
            for k, size in enumerate(sizes):  # 2^k parts of units / (2^S' - 1), +- one unit
                ideal = units * 2 ** k / (2 ** count - 1)
                assert abs(size - ideal) <= 1, (rows, slices, align, sizes)


def test_growing_exact_example_and_unknown_plan():
    assert slice_bounds(8192, 4, 1, "growing") == [0, 546, 1638, 3822, 8192]
    assert slice_bounds(7, 3, 1, "growing") == [0, 1, 3, 7]
    assert slice_bounds(2, 3, 1, "growing") == [0, 2]  # 3 units needed for two slices
    with pytest.raises(ValueError, match="plan 'ramp': expected one of uniform, growing"):
        slice_bounds(8, 2, 1, "ramp")
