"""Where ranks live: one rank's view of its world (docs/design.md, 'Worlds').

A :class:`World` carries the rank, the world size, the device, the process group (if
the ranks are processes), the rank's :class:`~radiance_ar.transport.peer_memory.PeerMemory` and,
optionally, the vendor all-reduce to use in place of ``torch.distributed.all_reduce``
(inside vLLM: vLLM's). Backends are built for a World and never ask torch.distributed
for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from radiance_ar.transport.peer_memory import (LocalMemory, PeerMemory, PinnedHostGroup,
    PinnedHostMemory, SharedFileMemory, SymmetricMemory)

#: how each kind of world is labelled on every figure it produces
WORLD_LABELS = {
    "cpu-shm": "CPU, {size} processes (gloo + shared memory)",
    "gpu-symm": "{size} GPUs, one process each (symmetric memory)",
    "gpu-emulated": "1 GPU, {size} emulated ranks over PCIe",
    "single": "1 rank, no peers",
}
#: every kind of world, as a backend gate names them
KINDS = tuple(WORLD_LABELS)
#: the largest world the built-in backends with kernels of their own serve: the inputs of
#: the sdma reduce kernel and the payload/flag pointer arguments of the oneshot_wht6 kernel
MAX_WORLD = 8


@dataclass
class World:
    rank: int
    size: int
    device: torch.device
    memory: PeerMemory
    group: dist.ProcessGroup | None = None
    #: the vendor collective to use instead of torch.distributed.all_reduce on the group:
    #: ``t -> sum over ranks of t`` (a new tensor); inside vLLM, vLLM's
    #: tensor_model_parallel_all_reduce (its custom AR / QuickReduce / NCCL). ``stock``
    #: calls it, so it also serves a world without a process group.
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def kind(self) -> str:
        return self.memory.kind

    @property
    def emulated(self) -> bool:
        return self.kind == "gpu-emulated"

    @property
    def label(self) -> str:
        return WORLD_LABELS[self.kind].format(size=self.size)


def from_process_group(group: dist.ProcessGroup | None = None,
                       device: torch.device | None = None,
                       all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> World:
    """Collective: this process's World in ``group`` (default: the whole job).

    CPU device -> shared-memory files; CUDA/ROCm device -> symmetric memory.
    ``all_reduce``: the vendor collective of :attr:`World.all_reduce` (None: the group's).
    """
    if not dist.is_initialized():
        raise RuntimeError("from_process_group: torch.distributed is not initialized "
                           "(run under torchrun, or use radiance_ar.harness.cpu_world for CPU ranks)")
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    if device.type == "cpu":
        memory: PeerMemory = SharedFileMemory(group)
    elif device.type == "cuda":
        if device.index is None:
            raise ValueError(f"from_process_group: device {device} needs an index (cuda:N)")
        memory = SymmetricMemory(group, device)
    else:
        raise ValueError(f"from_process_group: device type {device.type!r}: expected cpu or cuda")
    return World(memory.rank, memory.size, device, memory,
                 group if group is not None else dist.group.WORLD, all_reduce)


def emulated_worlds(size: int, device: torch.device) -> list[World]:
    """W ranks on one GPU in this process, peer buffers in pinned host memory."""
    if size < 1:
        raise ValueError(f"emulated_worlds: size must be >= 1, got {size}")
    if device.type != "cuda":
        raise ValueError(f"emulated_worlds: needs a CUDA/ROCm device, got {device}")
    group = PinnedHostGroup(size)
    return [World(r, size, device, PinnedHostMemory(group, r)) for r in range(size)]


def single_world(device: torch.device | str = "cpu") -> World:
    """A world of one rank (no process group): the op runs, every all-reduce is a copy."""
    device = torch.device(device)
    return World(0, 1, device, LocalMemory(device))
