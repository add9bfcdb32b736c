"""The op on one GPU (one-rank world): pipeline bits, graph capture, growth refusal, memory."""

import pytest
import torch

import backends
import overlap
import world_jobs
from backends.world import single_world
from overlap.config import OverlapSettings

pytestmark = pytest.mark.gpu


def runtime(min_m: int, slices: int):
    world = single_world("cuda:0")
    backend = world_jobs.PeerSumBackend(world)
    return overlap.OverlapRuntime(world, OverlapSettings(True, backend.name, min_m, slices), backend)


def inputs(rows, cols=256, k=512, seed=0):
    x, w = world_jobs.shard(seed, 0, rows, cols, k)
    return x.cuda(), w.cuda()


def test_sliced_pipeline_on_streams_equals_unsliced():
    x, w = inputs(1000)
    unsliced = overlap.forward(runtime(1, 1), x, w, None, "bf16")
    for slices in (2, 3, 4, 7):
        out = overlap.forward(runtime(1, slices), x, w, None, "bf16")
        torch.cuda.synchronize()
        assert torch.equal(out, unsliced), slices


@pytest.mark.parametrize("backend", backends.names())
def test_decode_path_of_every_backend_captures_and_replays_correctly(backend):
    world = single_world("cuda:0")
    reason = backends.get(backend).unsupported_reason(world)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    rt = overlap.build(world, OverlapSettings(True, backend, 64, 4))
    peer = (world.memory.allocations, world.memory.allocated_bytes)
    x, w = inputs(63, cols=512)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        overlap.forward(rt, static_x, w, None, "bf16")  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = overlap.forward(rt, static_x, w, None, "bf16")
    for seed in range(1, 6):
        new_x, _ = inputs(63, cols=512, seed=seed)
        static_x.copy_(new_x)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, torch.mm(new_x, w.t())), seed
    assert rt._lanes is None and rt.scratch.growths == 0
    assert (world.memory.allocations, world.memory.allocated_bytes) == peer
    rt.close()


def test_growth_during_capture_is_refused():
    rt = runtime(min_m=1, slices=2)
    x, w = inputs(64)
    overlap.forward(rt, x[:32].contiguous(), w, None, "bf16")  # scratch sized for 32 rows
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        with torch.cuda.graph(graph):
            overlap.forward(rt, x, w, None, "bf16")
    torch.cuda.synchronize()
    assert torch.equal(overlap.forward(rt, x, w, None, "bf16"), torch.mm(x, w.t()))


def test_memory_flat_over_5000_calls_of_random_m():
    rt = runtime(min_m=2048, slices=4)
    x, w = inputs(16384, cols=128, k=128)
    gen = torch.Generator().manual_seed(0)

    def calls(n):
        for _ in range(n):
            rows = int(torch.randint(1, 16385, (1,), generator=gen))
            overlap.forward(rt, x[:rows], w, None, "bf16")
        torch.cuda.synchronize()

    overlap.forward(rt, x, w, None, "bf16")  # the high-water mark: buffers stop growing here
    calls(300)  # warm-up: the allocator settles its segments for this size mix
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    calls(5000)
    assert torch.cuda.memory_reserved() == reserved
    assert torch.cuda.memory_allocated() == allocated
