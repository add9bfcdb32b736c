"""Peer memory of the gpu-host world: GPU ranks in separate processes, buffers in host memory.

Every rank's peer-visible buffers and flags live in the job-private shared-memory files
of :class:`~radiance_ar.transport.peer_memory.SharedFileMemory` (a 0700 job directory,
random 0600 files created with ``O_EXCL``, checked before a peer maps them, unlinked once
mapped). Each rank registers every mapping with its GPU runtime (``cudaHostRegister`` /
``hipHostRegister``, portable and mapped), so the peers' buffers are host tensors that
the copy engines (publish = D2H, pull = H2D), stream memory operations (flags) and
kernels (oneshot_wht6's loads) of its own process reach, exactly like the pinned buffers
of the emulated world. No peer-to-peer access is needed: each GPU's own host link
carries its publishes one way and its pulls the other.

Lifetime: a registration lives as long as the tensors over its mapping and is undone
when the last of them goes, BEFORE the mapping is unmapped (pages unmapped while still
registered would stay pinned). The tensor is made over a ctypes array over the mapping
(:class:`_RegisteredBytes`): the array's finalizer unregisters, then the array's release
of the mapping unmaps it. A registration that fails raises on every rank (the
allocation's agreement), and the mappings registered so far are unregistered as their
tensors go. A killed process leaves no registration (the driver drops its context).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Callable

import torch
import torch.distributed as dist

from radiance_ar.transport.copy_engine import platform
from radiance_ar.transport.peer_memory import PeerBuffer, SharedFileMemory


class HostRegistration:
    """The runtime calls that register host memory with ``device``'s runtime, resolved once
    per platform: ``register(ptr, nbytes)``, ``unregister(ptr)`` and ``device_pointer(ptr)``
    (the address the GPU uses; it must equal ``ptr``, see :meth:`register`)."""

    def __init__(self, device: torch.device):
        plat = platform(device)
        if plat == "cuda":
            from radiance_ar.transport import cuda_ops as ops

            self._register, self._unregister = ops.cuda_host_register, ops.cuda_host_unregister
            self._device_pointer = ops.cuda_device_pointer
        elif plat == "hip":
            from radiance_ar.transport import hip_ops as ops

            self._register, self._unregister = ops.hip_host_register, ops.hip_host_unregister
            self._device_pointer = ops.hip_device_pointer
        else:
            raise ValueError(f"HostRegistration: {device} has no GPU runtime (expected cuda)")
        self.device = torch.device(device)

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``ptr``; raise (unregistered again) unless the GPU sees
        them at ``ptr`` itself: every layer above passes host addresses to the GPU (copies,
        flags, kernel arguments), as it does for the emulated world's pinned memory."""
        self._register(ptr, nbytes)
        try:
            seen = self._device_pointer(ptr)
            if seen != ptr:
                raise RuntimeError(
                    f"RegisteredHostMemory: {self.device} maps registered host memory at "
                    f"{seen:#x}, not at its host address {ptr:#x}; the gpu-host world needs "
                    "unified addressing of registered memory (use RADIANCE_AR_PEER_MEMORY=symm)")
        except BaseException:
            self._unregister(ptr)
            raise

    def unregister(self, ptr: int) -> None:
        self._unregister(ptr)


@functools.cache
def _registered_bytes_type(nbytes: int) -> type:
    """The ctypes array type of ``nbytes`` bytes whose objects unregister when collected."""

    class _RegisteredBytes(ctypes.c_ubyte * nbytes):
        # set right after registering; None: nothing to undo
        unregister: Callable[[int], None] | None = None

        def __del__(self) -> None:
            # Runs before ctypes releases the mapping this array was made from (its base
            # object), so the pages are unregistered while still mapped. At interpreter
            # exit the runtime may be gone; the driver drops the process's registrations.
            if self.unregister is not None and not sys.is_finalizing():
                self.unregister(ctypes.addressof(self))

    return _RegisteredBytes


def registered_tensor(mapping: mmap.mmap, registration: HostRegistration) -> torch.Tensor:
    """uint8 [len(mapping)] over ``mapping``, registered with ``registration``'s runtime
    until the tensor and every view of it are gone (module doc)."""
    nbytes = len(mapping)
    array = _registered_bytes_type(nbytes).from_buffer(mapping)
    registration.register(ctypes.addressof(array), nbytes)
    array.unregister = registration.unregister
    return torch.frombuffer(array, dtype=torch.uint8)


class RegisteredHostMemory(SharedFileMemory):
    """GPU ranks in separate processes of one host (one process per rank, each on its own
    GPU or several on one); buffers in shared host memory registered with each rank's
    runtime (module doc). ``barrier`` and the allocations' agreement use ``group``, whose
    backend must take CPU objects (gloo, or NCCL/RCCL with a CPU side)."""

    kind = "gpu-host"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 root: str | None = None):
        self.registration = HostRegistration(device)
        super().__init__(group, root)

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        # Whole pages: a registration pins whole pages, and older runtimes refused a range
        # that is not page-aligned at both ends. The buffer is the first nbytes of them.
        pages = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        whole = super()._allocate(name, pages)
        return PeerBuffer(name, nbytes, self.rank, [p[:nbytes] for p in whole.peers])

    def _tensor(self, mapping: mmap.mmap) -> torch.Tensor:
        return registered_tensor(mapping, self.registration)
