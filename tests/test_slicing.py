"""Slice bounds cover every row exactly once, balanced, aligned, never empty."""

import pytest

from overlap.slicing import slice_bounds


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
