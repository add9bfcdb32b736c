"""sdma_wht6 in real CPU worlds: the codec's exact sum, same bits everywhere, wire bytes."""

import pytest
import torch

import sdma_wht6_jobs as jobs
from backends import wht6
from backends.sdma_wht6 import SdmaWht6Backend

SHAPES = [(8, 256), (33, 512), (5, 1024), (64, 256)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_result_is_the_codec_sum_identical_on_ranks_and_wire_bytes_are_moved(cpu_world, size):
    results = cpu_world(size).run(jobs.exact_job, SHAPES, 3, seed=size)
    for call, shape in enumerate(SHAPES):
        per_rank = [r[call] for r in results]
        for rank, res in enumerate(per_rank):
            assert not torch.isnan(res["out"]).any(), f"rank {rank}: unwritten elements"
            assert res["matches_codec"], f"rank {rank}, shape {shape}: not the codec's sum"
            assert res["pulled"] == res["wire"], (rank, shape, res["pulled"], res["wire"])
            assert res["rel_rms"] <= SdmaWht6Backend.rel_rms_bound
            assert torch.equal(res["out"], per_rank[0]["out"]), f"rank {rank} differs"


def test_through_the_op(cpu_world):
    results = cpu_world(2).run(jobs.op_job, 40, 512, 64, 4, seed=3)
    for r in results:
        assert r["rel_rms"] <= SdmaWht6Backend.rel_rms_bound
        assert torch.equal(r["out"], results[0]["out"])


def test_wire_bytes_are_the_payload_size():
    be = SdmaWht6Backend.__new__(SdmaWht6Backend)
    rows, cols = 8192, 5120
    assert be.wire_bytes(rows * cols, 4) == 3 * rows * wht6.payload_shape(rows, cols)[1]
    assert be.wire_bytes(rows * cols, 1) == 0
