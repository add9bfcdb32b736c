"""Jobs run on every rank of a CPU world (module-level so the pool can pickle them).

Each rank builds its shard from a generator seeded by (seed, rank), so any rank can
rebuild every rank's inputs and compute the float64 reference independently.
"""

from __future__ import annotations

import torch

import overlap
from backends.interface import Backend, check_slice, refuse_growth_in_capture
from backends.peer_memory import typed_view
from backends.world import World
from overlap.config import OverlapSettings


def shard(seed: int, rank: int, rows: int, cols: int, k: int,
          dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(cols, k, generator=g) / k ** 0.5).to(dtype)
    return x, w


def reference(seed: int, size: int, rows: int, cols: int, k: int) -> torch.Tensor:
    total = torch.zeros(rows, cols, dtype=torch.float64)
    for r in range(size):
        x, w = shard(seed, r, rows, cols, k)
        total += x.double() @ w.double().t()
    return total


class PeerSumBackend(Backend):
    """Test-only reference AR: barrier, fp32 sum of every rank's peer-visible rows, barrier.

    Independent of every shipped backend; it exists to check the pipeline's slicing.
    """

    name = "test_peer_sum"
    uses_compute_units_while_waiting = True
    capture_safe = False
    bit_exact = True
    peer_visible_input = True

    def __init__(self, world: World):
        super().__init__(world)
        self.buffer = None

    def ensure_capacity(self, max_rows, cols, dtype):
        nbytes = max_rows * cols * dtype.itemsize
        if self.buffer is None or self.buffer.nbytes < nbytes:
            refuse_growth_in_capture("test_peer_sum buffer", self.world.device)
            self.buffer = self.world.memory.allocate("test_peer_sum", nbytes)
        self.cols, self.dtype = cols, dtype

    def input_view(self, rows, cols, dtype):
        return typed_view(self.buffer.local, rows, cols, dtype)

    def all_reduce(self, slice_in, out):
        check_slice(slice_in, out)
        row_bytes = slice_in.shape[1] * slice_in.element_size()
        offset = slice_in.data_ptr() - self.buffer.local.data_ptr()
        self.world.memory.barrier()
        acc = torch.zeros(slice_in.shape, dtype=torch.float32, device=slice_in.device)
        for r in range(self.world.size):
            acc += typed_view(self.buffer.peer(r), slice_in.shape[0], slice_in.shape[1],
                              slice_in.dtype, offset).float()
        self.world.memory.barrier()
        assert offset % row_bytes == 0
        out.copy_(acc)

    def wire_bytes(self, numel, world_size, elem_size=2):
        return (world_size - 1) * numel * elem_size


def op_job(world: World, backend: str, rows: int, cols: int, k: int, slices: int,
           min_m: int, seed: int) -> dict:
    """One call of radiance::linear_ar (through the registered op) on this rank."""
    rt = overlap.configure(world, OverlapSettings(True, backend, min_m, slices))
    x, w = shard(seed, world.rank, rows, cols, k)
    out = torch.ops.radiance.linear_ar(x, w, None, "bf16")
    return {"out": out, "ref": reference(seed, world.size, rows, cols, k),
            "growths": rt.scratch.growths}


def pipeline_job(world: World, rows: int, cols: int, k: int, slices_list: list[int],
                 seed: int) -> dict:
    """The sliced pipeline with the test reference AR, for several slice counts."""
    results = {}
    backend = PeerSumBackend(world)
    for slices in slices_list:
        rt = overlap.OverlapRuntime(world, OverlapSettings(True, backend.name, 1, slices), backend)
        x, w = shard(seed, world.rank, rows, cols, k)
        results[slices] = overlap.forward(rt, x, w, None, "bf16")
    return {"outs": results, "ref": reference(seed, world.size, rows, cols, k)}
