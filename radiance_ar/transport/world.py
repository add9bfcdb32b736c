"""Where ranks live: one rank's view of its world (docs/design.md, 'Worlds').

A :class:`World` carries the rank, the world size, the device, the process group (if
the ranks are processes), the rank's :class:`~radiance_ar.transport.peer_memory.PeerMemory` and,
optionally, the vendor all-reduce to use in place of ``torch.distributed.all_reduce``
(inside vLLM: vLLM's). Backends are built for a World and never ask torch.distributed
for anything else.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
# Imported now, before a caller's init_process_group (which imports this module first):
# torch.distributed.nn.functional binds ``group.WORLD`` into ten functions' defaults when it
# is imported, and the op's first call imports it (torch.library -> torch._dynamo). Imported
# after init, it keeps the default group alive past destroy_process_group, with its gloo
# worker threads; one that drops a finished work item while the interpreter shuts down needs
# the GIL and aborts the process ("terminate called without an active exception": from
# ProcessGroupGloo::runLoop, ~AsyncWork -> decref -> take_gil -> pthread_exit; 2 of 67
# runs of the README program beside a CPU load, core file of 2026-12-05: docs/history.md).
import torch.distributed.nn.functional  # noqa: F401

from radiance_ar import envs
from radiance_ar.transport.peer_memory import (LocalMemory, PeerMemory, PinnedHostGroup,
    PinnedHostMemory, SharedFileMemory, SymmetricMemory)

#: how each kind of world is labelled on every figure it produces
WORLD_LABELS = {
    "cpu-shm": "CPU, {size} processes (gloo + shared memory)",
    "gpu-symm": "{size} GPUs, one process each (symmetric memory)",
    "gpu-emulated": "1 GPU, {size} emulated ranks over PCIe",
    "gpu-host": "{size} processes, GPU buffers staged in shared host memory",
    "single": "1 rank, no peers",
}
#: every kind of world, as a backend gate names them
KINDS = tuple(WORLD_LABELS)
#: the kinds whose peer buffers are host memory that a GPU reaches by DMA: a rank writes what
#: it publishes into a device stage, publishes by a D2H copy and pulls by H2D copies
HOST_BUFFER_KINDS = ("gpu-emulated", "gpu-host")
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
    #: why this world's peer memory was chosen (``from_process_group``; empty elsewhere)
    memory_reason: str = ""

    @property
    def kind(self) -> str:
        return self.memory.kind

    @property
    def emulated(self) -> bool:
        """W ranks driven by ONE process (passive peers, the publish lane, one host thread)."""
        return self.kind == "gpu-emulated"

    @property
    def host_buffers(self) -> bool:
        """Peer buffers in host memory reached by a GPU's DMA (:data:`HOST_BUFFER_KINDS`)."""
        return self.kind in HOST_BUFFER_KINDS

    @property
    def label(self) -> str:
        return WORLD_LABELS[self.kind].format(size=self.size)


def from_process_group(group: dist.ProcessGroup | None = None,
                       device: torch.device | None = None,
                       all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       peer_memory: str | None = None) -> World:
    """Collective: this process's World in ``group`` (default: the whole job).

    CPU device -> shared-memory files (cpu-shm); CUDA/ROCm device -> symmetric memory
    (gpu-symm) or registered shared host memory (gpu-host), as ``peer_memory`` says
    (``symm``, ``host`` or ``auto``; None: ``RADIANCE_AR_PEER_MEMORY``; rule:
    :func:`choose_peer_memory`). ``all_reduce``: the vendor collective of
    :attr:`World.all_reduce` (None: the group's).
    """
    if device is not None and not isinstance(device, torch.device):
        raise TypeError(f"from_process_group: device must be a torch.device, got "
                        f"{type(device).__name__} {device!r}")
    given = peer_memory
    if peer_memory is None:
        peer_memory = envs.get("RADIANCE_AR_PEER_MEMORY")
    elif peer_memory not in envs.PEER_MEMORIES:
        raise ValueError(f"from_process_group: peer_memory {peer_memory!r}: expected one of "
                         f"{', '.join(envs.PEER_MEMORIES)}")
    if device is not None and device.type == "cpu" and given not in (None, "auto"):
        raise ValueError(f"from_process_group: peer_memory {given!r} is for GPU ranks; CPU "
                         "ranks share memory files (cpu-shm): pass None or 'auto'")
    if not dist.is_initialized():
        raise RuntimeError("from_process_group: torch.distributed is not initialized "
                           "(run under torchrun, or use radiance_ar.harness.cpu_world for CPU ranks)")
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    reason = ""
    if device.type == "cpu":
        memory: PeerMemory = SharedFileMemory(group)
    elif device.type == "cuda":
        if device.index is None:
            raise ValueError(f"from_process_group: device {device} needs an index (cuda:N)")
        places: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(places, gpu_place(device), group=group)
        choice, reason = choose_peer_memory(peer_memory, places)
        if dist.get_rank(group) == 0:
            _log_choice_once(choice, reason)
        if choice == "host":
            from radiance_ar.transport.host_peer_memory import RegisteredHostMemory

            memory = RegisteredHostMemory(group, device)
        else:
            memory = SymmetricMemory(group, device)
    else:
        raise ValueError(f"from_process_group: device type {device.type!r}: expected cpu or cuda")
    return World(memory.rank, memory.size, device, memory,
                 group if group is not None else dist.group.WORLD, all_reduce, reason)


@dataclass(frozen=True)
class GpuPlace:
    """Where one rank's GPU is: its host, the GPU's UUID, its index in the rank's process,
    and the UUIDs of the GPUs visible to that process that it can access as peers."""
    host: str
    uuid: str
    index: int
    peers: tuple[str, ...]


def gpu_place(device: torch.device) -> GpuPlace:
    """This process's :class:`GpuPlace` for ``device``."""
    peers = tuple(_uuid(j) for j in range(torch.cuda.device_count())
                  if j != device.index and torch.cuda.can_device_access_peer(device.index, j))
    return GpuPlace(socket.gethostname(), _uuid(device.index), device.index, peers)


def _uuid(index: int) -> str:
    # The physical GPU: two processes that see one GPU under different indices (their own
    # CUDA_VISIBLE_DEVICES) still find that they share it.
    return str(torch.cuda.get_device_properties(index).uuid)


def choose_peer_memory(setting: str, places: Sequence[GpuPlace]) -> tuple[str, str]:
    """(``"symm"`` or ``"host"``, why) for ranks on ``places`` (rank order) under
    ``setting`` (``RADIANCE_AR_PEER_MEMORY``). Every rank computes it from the same
    gathered places, so all agree. ``auto``: host memory where two ranks share a GPU or a
    pair of GPUs cannot access each other as peers (symmetric memory needs both); symmetric
    memory otherwise, and where the ranks span hosts (host memory is one host's)."""
    if setting not in envs.PEER_MEMORIES:
        raise ValueError(f"choose_peer_memory: setting {setting!r}: expected one of "
                         f"{', '.join(envs.PEER_MEMORIES)}")
    hosts = sorted({p.host for p in places})
    if setting == "host" and len(hosts) > 1:
        raise ValueError(f"RADIANCE_AR_PEER_MEMORY=host: the ranks span {len(hosts)} hosts "
                         f"({', '.join(hosts)}); host memory is shared within one host only")
    if setting != "auto":
        return setting, f"RADIANCE_AR_PEER_MEMORY={setting}"
    if len(hosts) > 1:
        return "symm", f"the ranks span {len(hosts)} hosts (host memory is one host's)"
    first: dict[str, int] = {}
    for r, p in enumerate(places):
        if p.uuid in first:
            q = first[p.uuid]
            return "host", (f"ranks {q} and {r} share one GPU (cuda:{places[q].index} of rank "
                            f"{q}); symmetric memory needs a GPU per rank")
        first[p.uuid] = r
    for r, p in enumerate(places):
        for q, o in enumerate(places):
            if q != r and o.uuid not in p.peers:
                return "host", (f"rank {r}'s GPU (cuda:{p.index}) cannot access rank {q}'s "
                                f"(cuda:{o.index} there) as a peer: no peer-to-peer")
    return "symm", "every rank has a GPU of its own and every pair access each other as peers"


_logged: set[str] = set()


def log_once(level: int, message: str) -> None:
    """Log ``message`` on the ``radiance_ar`` logger, the first time it is seen in this
    process only (a reason that holds for every call or rank, said once)."""
    if message not in _logged:
        _logged.add(message)
        logging.getLogger("radiance_ar").log(level, message)


def _log_choice_once(choice: str, reason: str) -> None:
    log_once(logging.WARNING, f"radiance-ar peer memory: {choice} "
             f"({'gpu-host' if choice == 'host' else 'gpu-symm'} world): {reason}")


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
