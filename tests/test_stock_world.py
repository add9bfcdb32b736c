"""The op with the stock backend, and the sliced pipeline, in real multi-process CPU worlds."""

import pytest
import torch

import world_jobs

# bf16 output of a K=64 dot product: one rounding of the result (2^-8 relative) plus the
# ranks' bf16 partial sums; 2^-6 of the reference's scale bounds both with margin.
REL_TOL = 2.0 ** -6


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("rows,min_m", [(5, 1), (64, 1), (64, 65)])
def test_stock_op_matches_float64_sum_and_is_identical_on_every_rank(cpu_world, size, rows, min_m):
    results = cpu_world(size).run(world_jobs.op_job, "stock", rows, 48, 64, 4, min_m, seed=rows)
    ref = results[0]["ref"]
    scale = ref.abs().max().item()
    for rank, r in enumerate(results):
        assert r["out"].dtype == torch.bfloat16 and r["out"].shape == ref.shape
        err = (r["out"].double() - ref).abs().max().item()
        assert err <= REL_TOL * scale, f"rank {rank}: max error {err} vs scale {scale}"
        assert torch.equal(r["out"], results[0]["out"]), f"rank {rank} differs from rank 0"


@pytest.mark.parametrize("size", [2, 3])
def test_sliced_pipeline_equals_unsliced_for_every_slice_count(cpu_world, size):
    slices_list = [1, 2, 3, 4, 7]
    results = cpu_world(size).run(world_jobs.pipeline_job, 37, 40, 32, slices_list, seed=7)
    ref = results[0]["ref"]
    for rank, r in enumerate(results):
        unsliced = r["outs"][1]
        assert (unsliced.double() - ref).abs().max() <= REL_TOL * ref.abs().max()
        for s in slices_list:
            # Row slicing of a row-independent GEMM is exact, and the reference AR sums in
            # the same order whatever the slice: the bits must not move.
            assert torch.equal(r["outs"][s], unsliced), f"rank {rank}, S={s}"
            assert torch.equal(r["outs"][s], results[0]["outs"][s]), f"rank {rank} != rank 0"


def test_stock_uses_the_worlds_vendor_all_reduce():
    """A world that carries a vendor collective (vLLM's, inside vLLM) needs no process
    group: stock calls it, and never torch.distributed."""
    from radiance_ar import backends
    from radiance_ar.transport.peer_memory import LocalMemory
    from radiance_ar.transport.world import World

    calls = []

    def vendor(t):
        calls.append(t.shape)
        return t * 2  # two ranks holding the same tensor

    cpu = torch.device("cpu")
    stock = backends.get("stock")
    assert "needs a process group" in stock.unsupported_reason(World(0, 2, cpu, LocalMemory(cpu)))
    world = World(0, 2, cpu, LocalMemory(cpu), all_reduce=vendor)
    assert stock.unsupported_reason(world) is None
    x = torch.arange(6.0).view(2, 3)
    out = torch.full_like(x, float("nan"))
    stock(world).all_reduce(x, out)
    assert calls == [(2, 3)] and torch.equal(out, 2 * x)
