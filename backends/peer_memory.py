"""Peer-visible buffers: memory each rank writes and every other rank can read.

One implementation per kind of world (DESIGN 3.4), plus :class:`LocalMemory` for a
world of one rank:

- :class:`SharedFileMemory`: CPU ranks in separate processes; one file per rank in
  ``/dev/shm`` mapped by every rank (the CI test bed).
- :class:`SymmetricMemory`: one GPU per process; ``torch.distributed._symmetric_memory``
  (CUDA, and ROCm since torch 2.8 through HIP VMM).
- :class:`PinnedHostMemory`: W emulated ranks in one process on one GPU; every rank's
  buffer in pinned host memory, so each cross-rank byte crosses the host link (PCIe),
  as on a PCIe multi-GPU box.

``allocate`` and ``barrier`` are collective: every rank calls them in the same order.
A :class:`PeerBuffer` is raw bytes; :func:`typed_view` gives a typed 2-D view.
"""

from __future__ import annotations

import abc
import os
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class PeerBuffer:
    name: str
    nbytes: int
    rank: int
    peers: list[torch.Tensor]  # uint8 [nbytes] of every rank, this rank's included
    _keepalive: list = field(default_factory=list, repr=False)

    @property
    def local(self) -> torch.Tensor:
        return self.peers[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        return self.peers[rank]


def typed_view(raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype,
               byte_offset: int = 0) -> torch.Tensor:
    """A ``rows x cols`` view of ``dtype`` into the uint8 tensor ``raw`` at ``byte_offset``."""
    size = dtype.itemsize
    nbytes = rows * cols * size
    assert byte_offset % size == 0 and byte_offset + nbytes <= raw.numel(), (
        f"view of {nbytes} B at {byte_offset} exceeds buffer of {raw.numel()} B")
    return raw[byte_offset:byte_offset + nbytes].view(dtype).view(rows, cols)


class PeerMemory(abc.ABC):
    """Allocates :class:`PeerBuffer` s for one rank of a world."""

    kind: str

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        #: allocations made and bytes allocated by this rank (flat after warm-up)
        self.allocations = 0
        self.allocated_bytes = 0

    def allocate(self, name: str, nbytes: int) -> PeerBuffer:
        """Collective: a fresh zero-filled buffer of ``nbytes`` on every rank."""
        if nbytes < 1:
            raise ValueError(f"peer buffer {name!r}: nbytes must be >= 1, got {nbytes}")
        self.allocations += 1
        self.allocated_bytes += nbytes
        return self._allocate(name, nbytes)

    @abc.abstractmethod
    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        """The implementation's allocation (see :meth:`allocate`)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective host barrier."""


class SharedFileMemory(PeerMemory):
    """CPU processes of one gloo group; buffers are ``/dev/shm`` files mapped by all ranks.

    The files are unlinked as soon as every rank has mapped them, so a crashed run leaves
    nothing behind in ``/dev/shm``.
    """

    kind = "cpu-shm"

    def __init__(self, group: dist.ProcessGroup | None, root: str = "/dev/shm"):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)
        self._prefix = os.path.join(root, f"radiance-ar-{token[0]}")
        self._serial = 0

    def _path(self, serial: int, rank: int) -> str:
        return f"{self._prefix}-{serial}-r{rank}"

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        self._serial += 1
        mine = self._path(self._serial, self.rank)
        storage = torch.UntypedStorage.from_file(mine, shared=True, nbytes=nbytes)
        local = torch.empty(0, dtype=torch.uint8).set_(storage).zero_()
        self.barrier()
        peers = []
        for r in range(self.size):
            if r == self.rank:
                peers.append(local)
                continue
            st = torch.UntypedStorage.from_file(self._path(self._serial, r), shared=True,
                                                nbytes=nbytes)
            peers.append(torch.empty(0, dtype=torch.uint8).set_(st))
        self.barrier()
        os.unlink(mine)
        return PeerBuffer(name, nbytes, self.rank, peers)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class SymmetricMemory(PeerMemory):
    """One GPU per process: torch symmetric memory, rendezvoused on ``group``."""

    kind = "gpu-symm"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group, self.device = group, device

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        import torch.distributed._symmetric_memory as symm_mem

        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        local.zero_()
        group = self.group if self.group is not None else dist.group.WORLD
        handle = symm_mem.rendezvous(local, group.group_name)
        peers = [local if r == self.rank else handle.get_buffer(r, (nbytes,), torch.uint8, 0)
                 for r in range(self.size)]
        torch.cuda.synchronize(self.device)
        self.barrier()
        return PeerBuffer(name, nbytes, self.rank, peers, _keepalive=[handle])

    def barrier(self) -> None:
        dist.barrier(group=self.group, device_ids=[self.device.index])


class LocalMemory(PeerMemory):
    """A world of one rank: plain memory on its device, no peers."""

    kind = "single"

    def __init__(self, device: torch.device):
        super().__init__(0, 1)
        self.device = device

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        return PeerBuffer(name, nbytes, 0, [torch.zeros(nbytes, dtype=torch.uint8,
                                                        device=self.device)])

    def barrier(self) -> None:
        return None


class PinnedHostGroup:
    """State shared by the W emulated ranks of one process: one buffer set per allocation."""

    def __init__(self, size: int):
        self.size = size
        self._buffers: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self._serial = [0] * size

    def buffers(self, rank: int, name: str, nbytes: int) -> list[torch.Tensor]:
        # Ranks allocate in the same order (collective), so the k-th allocation of every
        # rank names the same buffer set whichever rank asks first.
        self._serial[rank] += 1
        key = (name, nbytes, self._serial[rank])
        if key not in self._buffers:
            self._buffers[key] = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
                                  for _ in range(self.size)]
        return self._buffers[key]


class PinnedHostMemory(PeerMemory):
    """One of W emulated ranks on one GPU; buffers in pinned host memory (see module doc)."""

    kind = "gpu-emulated"

    def __init__(self, group: PinnedHostGroup, rank: int):
        super().__init__(rank, group.size)
        self.group = group

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        return PeerBuffer(name, nbytes, self.rank, self.group.buffers(self.rank, name, nbytes))

    def barrier(self) -> None:
        # All emulated ranks live in this process and are driven in program order.
        return None
