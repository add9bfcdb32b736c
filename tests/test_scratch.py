"""radiance_ar/overlap/scratch.py on a GPU, with stand-ins for its streams and allocations."""

import contextlib
from types import SimpleNamespace

import torch

from radiance_ar import overlap
from radiance_ar.overlap import scratch
from radiance_ar.overlap.config import OverlapSettings


def test_the_scratch_pool_allocates_on_its_own_stream(monkeypatch):
    """ScratchPool on a GPU (stand-ins here): every buffer is allocated while the pool's
    own dedicated stream is current (a dropped one's bytes go back to that stream only),
    one stream per device, made at the runtime's build or the first growth."""
    current, made, allocated = [None], [], []

    @contextlib.contextmanager
    def stream(s):
        before, current[0] = current[0], s
        yield
        current[0] = before

    def empty(n, dtype, device):
        allocated.append(current[0])
        return torch.zeros(n, dtype=dtype)

    monkeypatch.setattr(scratch, "dedicated_stream", lambda device: made.append(device) or
                        f"own stream of {device}")
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    pool = scratch.ScratchPool()
    gpu = torch.device("cuda", 0)
    pool.get("gemm_out", (4, 8), torch.bfloat16, gpu)
    pool.get("gemm_out", (64, 8), torch.bfloat16, gpu)  # a growth
    pool.get("x_fp8", (4, 8), torch.float8_e4m3fn, gpu)
    assert allocated == ["own stream of cuda:0"] * 3 and made == [gpu]
    assert current[0] is None  # the caller's stream is current again
    # A runtime makes its pool's stream when it is built, before any call: made during an
    # emulated rank's call, with peers parked, its creation blocked (H100, test_auto_gpu).
    # A runtime that shares the pool (an auto child) makes no second one.
    made.clear()
    shared = scratch.ScratchPool()
    settings = OverlapSettings(True, "sdma", 1, 2)
    world = SimpleNamespace(device=gpu)
    overlap.OverlapRuntime(world, settings, None, scratch=shared)
    assert made == [gpu]
    overlap.OverlapRuntime(world, settings, None, scratch=shared)
    shared.get("gemm_out", (4, 8), torch.bfloat16, gpu)
    assert made == [gpu] and allocated[-1] == "own stream of cuda:0"
