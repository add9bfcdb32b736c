"""The op on one GPU (one-rank world): pipeline bits, graph capture, growth refusal, memory;
and every waiting backend refusing growth in capture (two emulated ranks)."""

import pytest
import torch

from radiance_ar import backends
from radiance_ar import overlap
import world_jobs
from radiance_ar.transport.world import emulated_worlds, single_world
from radiance_ar.overlap.config import OverlapSettings

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


def test_capture_refuses_backends_not_capture_safe_and_growth():
    rt = runtime(min_m=1, slices=2)
    x, w = inputs(64)
    overlap.forward(rt, x[:32].contiguous(), w, None, "bf16")  # scratch sized for 32 rows
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="'test_peer_sum' cannot run its sliced path .* "
                       "inside CUDA-graph capture: its calls are not capture-safe"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            overlap.forward(rt, x[:32].contiguous(), w, None, "bf16")
    rt.backend.capture_safe = True  # one rank: it has no call numbers a replay could repeat
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            overlap.forward(rt, x, w, None, "bf16")
    torch.cuda.synchronize()
    assert torch.equal(overlap.forward(rt, x, w, None, "bf16"), torch.mm(x, w.t()))


@pytest.mark.parametrize("backend", world_jobs.waiting_backends())
def test_backend_growth_during_capture_is_refused_and_the_buffers_stay(backend):
    # Two emulated ranks: peer-visible buffers in pinned host memory, as in the compare tool.
    bes = [backends.get(backend)(w) for w in emulated_worlds(2, torch.device("cuda", 0))]
    for be in bes:
        be.ensure_capacity(8, 256, torch.bfloat16)
    torch.cuda.synchronize()
    capacity = [be.capacity for be in bes]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        with torch.cuda.graph(graph):
            bes[0].ensure_capacity(64, 256, torch.bfloat16)
    assert [be.capacity for be in bes] == capacity
    xs = [world_jobs.slice_input(8, r, 8, 256).cuda() for r in range(2)]
    outs = [torch.full_like(x, float("nan")) for x in xs]
    streams = [torch.cuda.Stream() for _ in bes]
    for be, s, x, out in zip(bes, streams, xs, outs):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            be.all_reduce(x, out)
    for be in bes:
        be.check()
    torch.cuda.synchronize()
    world_jobs.assert_right_on_every_rank(
        [{"out": o.cpu(), "ref": world_jobs.inputs_sum(8, 2, 8, 256), "bound": be.rel_rms_bound}
         for o, be in zip(outs, bes)])
    for be in bes:
        be.close()


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
