"""Reference peers: torch symmetric-memory all-reduce (``symm_oneshot``, ``symm_twoshot``).

Not ours to improve, there to be measured against in the same run: PyTorch's
``torch.ops.symm_mem.one_shot_all_reduce_out`` (every rank reads every peer's buffer
over P2P) and ``two_shot_all_reduce_out`` (reduce-scatter + all-gather through peer
memory). Both are kernels that wait on signal pads with their CTAs, so they occupy
compute units while waiting. They need one GPU per process (torchrun) and an input
that lives in symmetric memory: the producer GEMM writes straight into it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from radiance_ar.envs import BackendSettings
from radiance_ar.backends.interface import Backend, check_slice
from radiance_ar.buffers import refuse_growth_in_capture
from radiance_ar.transport.peer_memory import PeerBuffer, typed_view
from radiance_ar.backends.registry import register
from radiance_ar.transport.world import World


class _SymmMemAllReduce(Backend):
    uses_compute_units_while_waiting = True
    capture_safe = False  # not checked here
    bit_exact = False  # accumulation order/precision is PyTorch's, not checked here
    rel_rms_bound = 2.0 ** -6
    peer_visible_input = True
    op_name: ClassVar[str]

    def __init__(self, world: World, settings: BackendSettings | None = None):
        super().__init__(world, settings)
        self.buffer: PeerBuffer | None = None
        self.group_name = world.group.group_name

    @classmethod
    def unsupported_reason(cls, world: World) -> str | None:
        if world.kind != "gpu-symm":
            return (f"torch symmetric-memory all-reduce needs one GPU per process under "
                    f"torchrun; this world is {world.label}")
        if world.size < 2:
            # torch raises "Not implemented for world_size=1" (torch 2.11, H200)
            return "torch symmetric-memory all-reduce needs world size >= 2"
        return None

    def ensure_capacity(self, max_rows: int, cols: int, dtype: torch.dtype) -> None:
        nbytes = max_rows * cols * dtype.itemsize
        if self.buffer is None or self.buffer.nbytes < nbytes:
            refuse_growth_in_capture(f"{self.name} buffer ({nbytes} B)", self.world.device)
            self.buffer = None
            self.buffer = self.world.memory.allocate(self.name, nbytes)

    def acquire_input_view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        self.ensure_capacity(rows, cols, dtype)
        return typed_view(self.buffer.local, rows, cols, dtype)

    def all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor) -> None:
        check_slice(slice_in, out)
        base = self.buffer.local.data_ptr() if self.buffer is not None else -1
        inside = (self.buffer is not None and base <= slice_in.data_ptr()
                  and slice_in.data_ptr() + slice_in.nbytes <= base + self.buffer.nbytes)
        if not inside:
            # A caller's tensor: stage it at the start of the symmetric buffer.
            staged = self.acquire_input_view(slice_in.shape[0], slice_in.shape[1], slice_in.dtype)
            staged.copy_(slice_in)
            slice_in = staged
        getattr(torch.ops.symm_mem, self.op_name)(slice_in, "sum", self.group_name, out)

    def close(self) -> None:
        self.buffer = None


@register("symm_oneshot")
class SymmOneShot(_SymmMemAllReduce):
    op_name = "one_shot_all_reduce_out"

    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        # Every peer reads this rank's whole slice once.
        return (world_size - 1) * numel * elem_size


@register("symm_twoshot")
class SymmTwoShot(_SymmMemAllReduce):
    op_name = "two_shot_all_reduce_out"

    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        return 2 * (world_size - 1) * numel * elem_size // world_size
