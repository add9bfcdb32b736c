"""The no-compute-unit copy layer: DMA copies and stream memory operations, per platform.

Every operation is enqueued on a caller-given stream handle (an int: ``cudaStream_t`` /
``hipStream_t``, 0 on the CPU), never synchronizes the host, and checks the error code
of every call. One function per platform and operation:

================  =====================================  ===================================
platform          copy                                   signal (write / wait)
================  =====================================  ===================================
NVIDIA (cuda)     ``cudaMemcpyAsync`` (kind Default: UVA  ``cuStreamWriteValue32`` /
                  picks H2D / D2H / P2P; copy engines)    ``cuStreamWaitValue32`` GEQ / EQ
                                                          (the front end: no kernel)
ROCm (hip)        ``hipMemcpyAsync`` kind                 ``hipStreamWriteValue64`` /
                  ``hipMemcpyDeviceToDeviceNoCU`` (1024)  ``hipStreamWaitValue64`` Gte/Eq
                  for same-device views of peer memory;   (clr: a one-work-item kernel)
                  ``hipMemcpyPeerAsync`` across devices;
                  kind Default for host memory
CPU               ``memmove`` (shared-memory files)       (host spin: see radiance_ar.transport.signals)
================  =====================================  ===================================

Why these calls: a same-device D2D ``hipMemcpy`` is a blit kernel on CUs unless its kind
is NoCU (as reported by earlier work on ROCm); H2D/D2H copies from pinned memory run on
the copy engines and complete while every SM is held (:mod:`radiance_ar.diagnostics.cu_free_check`;
its H200 results are in docs/history.md); on NVIDIA a stream wait-value is executed by
the GPU's front end, so a stream waits for a peer's flag without any spinning kernel (ROCm's
clr runs it as a one-work-item kernel: :mod:`radiance_ar.transport.hip_ops`).

Each runtime's calls live in a file of their own (:mod:`radiance_ar.transport.cuda_ops`,
:mod:`radiance_ar.transport.hip_ops`; the CPU's are a ``memmove`` here); this module
dispatches to them, makes dedicated streams and routes copies. The bindings are imported
at the first call, so every module imports everywhere; a missing package raises
:class:`~radiance_ar.transport.runtime_errors.BindingsMissing` naming the pip package to
install (``cuda-python`` for NVIDIA, ``hip-python`` for ROCm).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from radiance_ar.streams import stream_object

from radiance_ar.transport.cuda_ops import (_cuda, _cuda_ok, cuda_batch, cuda_copy,
    cuda_device_pointer, cuda_wait_value, cuda_write_value)
from radiance_ar.transport.hip_capture import hip_capture_batch
from radiance_ar.transport.hip_ops import (_hip, _hip_ok, hip_batch, hip_copy, hip_peer_copy,
    hip_wait_value, hip_write_value)
from radiance_ar.transport.runtime_errors import BindingsMissing


def platform(device: torch.device) -> str:
    """``"cpu"``, ``"cuda"`` (NVIDIA) or ``"hip"`` (ROCm torch also says ``cuda``)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "hip" if getattr(torch.version, "hip", None) else "cuda"
    raise ValueError(f"copy_engine: device type {device.type!r}: expected cpu or cuda")


# --------------------------------------------------------------------------- streams

#: cudaStreamNonBlocking / hipStreamNonBlocking (cuda_runtime_api.h, hip_runtime_api.h):
#: no implicit synchronization with the legacy default stream, like torch's pool streams
STREAM_NON_BLOCKING = 0x01


def dedicated_stream(device: torch.device) -> torch.cuda.Stream:
    """A new non-blocking stream that no other stream of the process shares, destroyed
    when the returned object is collected (work still queued on it completes first).

    Why not ``torch.cuda.Stream()``: it hands out the streams of a fixed pool (32 per
    priority) round robin, so the 33rd stream made is the first one again. Emulated
    ranks keep several persistent streams each (their own, the publish lane, the
    transport's), and two ranks' streams that alias serialize one rank's work behind
    another's wait on a flag it has not posted yet: a deadlock (on the H200, with pool
    streams, ``test_emulated_ranks_through_the_op[4-twoshot]`` times out: docs/history.md).

    The returned object owns the handle: keep it (not only its ``cuda_stream`` integer)
    for as long as work is enqueued on the stream, and free what was allocated while it
    was current (after a synchronization) before it goes: the caching allocator pools such
    blocks under the handle, which a later stream may get again (docs/design.md 5.2)."""
    device = torch.device(device)
    plat = platform(device)
    if plat == "cpu":
        raise ValueError(f"dedicated_stream: {device} has no streams (expected a GPU)")
    with torch.cuda.device(device):
        if plat == "cuda":
            _, runtime = _cuda()
            (raw,) = _cuda_ok(runtime.cudaStreamCreateWithFlags(STREAM_NON_BLOCKING),
                              "cudaStreamCreateWithFlags")
            destroy = runtime.cudaStreamDestroy
        else:
            hip = _hip()
            (raw,) = _hip_ok("hipStreamCreateWithFlags", hip.hipStreamCreateWithFlags,
                             STREAM_NON_BLOCKING)
            destroy = hip.hipStreamDestroy
    handle = int(raw)  # the destroy takes the integer; no bindings object is kept
    try:
        stream = _owning_stream_class(torch.cuda.ExternalStream)(handle, device=device)
    except BaseException:
        destroy(handle)  # nothing owns it yet
        raise
    stream.destroy_call = destroy
    return stream


@functools.cache
def _owning_stream_class(external: type) -> type:
    """The subclass of ``external`` (``torch.cuda.ExternalStream``) whose objects destroy
    their stream when collected. A ``__del__``, not ``weakref.finalize``: torch's CUDA
    stream deallocator never clears the object's weak references, so such a callback never
    runs and the interpreter's last collection writes through the dangling reference: a
    segmentation fault at process exit (H200, torch 2.11, under cuda-gdb:
    tools/results/2026-12-03-h200-exit-crash/)."""

    class OwningStream(external):
        destroy_call = None  # the runtime's stream destroy, set right after construction

        def __del__(self) -> None:
            if self.destroy_call is not None:
                _destroy_stream(self.destroy_call, self.cuda_stream)

    return OwningStream


def _destroy_stream(destroy: Any, handle: int) -> None:
    """Destroy a dedicated stream by its handle, except while the interpreter shuts down:
    the runtime may be torn down by then, and the driver releases the context's streams."""
    if not sys.is_finalizing():
        destroy(handle)


# --------------------------------------------------------------------------- dispatch

def bindings_reason(device: torch.device) -> str | None:
    """``None`` if the copy layer can run on ``device``, else why not (names the package)."""
    plat = platform(device)
    if plat == "cpu":
        return None
    try:
        _cuda() if plat == "cuda" else _hip()
    except BindingsMissing as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Route:
    """How copies between two memories are enqueued, decided once per pair of buffers so
    that a call's copies are plain address arithmetic (no tensor view per step).
    ``kind``: ``cpu`` (memmove), ``cuda`` (cudaMemcpyAsync Default), ``hip-peer``
    (hipMemcpyPeerAsync between ``dst_device`` and ``src_device``), ``hip-nocu`` (both
    on this device) or ``hip-default`` (host memory involved; inside a graph, a peer copy
    too: :meth:`in_graph`)."""
    kind: str
    dst_device: int = -1
    src_device: int = -1

    def in_graph(self) -> Route:
        """The route of the same copies inside a graph capture: ``hipMemcpyPeerAsync`` has
        no capture hook in clr (under capture it would run at once), so a peer copy is a
        ``hipMemcpyAsync`` of kind Default there, which clr captures as a memcpy node and
        runs as a peer-to-peer copy command, as it runs ``hipMemcpyPeerAsync``."""
        return Route("hip-default") if self.kind == "hip-peer" else self


def copy_bytes(dst_ptr: int, src_ptr: int, nbytes: int, stream: int, how: Route) -> None:
    """Enqueue a copy of ``nbytes`` from ``src_ptr`` to ``dst_ptr`` on ``stream`` along
    ``how`` (the callers own the bounds: addresses inside buffers they hold)."""
    if how.kind == "cuda":
        cuda_copy(dst_ptr, src_ptr, nbytes, stream)
    elif how.kind == "cpu":
        ctypes.memmove(dst_ptr, src_ptr, nbytes)
    elif how.kind == "hip-peer":
        hip_peer_copy(dst_ptr, how.dst_device, src_ptr, how.src_device, nbytes, stream)
    else:
        hip_copy(dst_ptr, src_ptr, nbytes, stream, no_cu=how.kind == "hip-nocu")


def host_array(addr: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` at host address ``addr`` as a CPU tensor, no copy: CPU
    worlds run the same by-address steps as GPU worlds (the caller owns the memory)."""
    return torch.frombuffer((ctypes.c_byte * (n * dtype.itemsize)).from_address(addr),
                            dtype=dtype, count=n)


def _byte_span(t: torch.Tensor, label: str) -> tuple[int, int]:
    """(address, bytes) of a contiguous tensor (no view is made: this runs per step)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"copy: {label} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"copy: {label} must be contiguous")
    return t.data_ptr(), t.numel() * t.element_size()


def _not_in_hip_capture(*_args: Any) -> None:
    raise AssertionError("a single stream memory operation inside a ROCm capture: HIP's "
                         "capture would not record it (CopyEngine.in_graph)")


def _host_signals_only(*_args: Any) -> None:
    raise TypeError("copy_engine: CPU worlds signal and wait on the host (radiance_ar.transport.signals)")


class CopyEngine:
    """Copies and stream memory operations for one device (see the module doc)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.platform = platform(self.device)
        reason = bindings_reason(self.device)
        if reason is not None:
            raise BindingsMissing(reason)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._route = Route(self.platform)  # every copy's route off ROCm (:meth:`route`)
        #: ``write_value(stream, addr, value)``: enqueue a flag write (GPU only);
        #: ``wait_value_geq`` / ``wait_value_eq(stream, addr, value)``: later work of the
        #: stream waits until the flag reaches (cyclic GEQ) / equals ``value`` (GPU only);
        #: ``batch(stream, ops)``: ``("write" | "wait_eq" | "wait_geq", addr, value)``
        #: operations in order, one graph node per 255 operations on CUDA (GPU only)
        self._bind_signal_ops()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: int) -> int:
        """Enqueue ``dst[:] = src`` (same byte count) on ``stream``; returns bytes moved."""
        (d_ptr, nbytes), (s_ptr, s_bytes) = _byte_span(dst, "dst"), _byte_span(src, "src")
        if nbytes != s_bytes:
            raise ValueError(f"copy: dst has {nbytes} B but src has {s_bytes} B")
        if nbytes:
            copy_bytes(d_ptr, s_ptr, nbytes, stream, self.route(dst, src))
        return nbytes

    def route(self, dst: torch.Tensor, src: torch.Tensor) -> Route:
        """The :class:`Route` of copies from ``src``'s memory into ``dst``'s (the module
        doc's table): one per platform, except on ROCm, where it depends on the memories."""
        if self.platform != "hip":
            return self._route
        if dst.is_cuda and src.is_cuda and dst.device != src.device:
            return Route("hip-peer", dst.device.index, src.device.index)
        # Both on this device (peer memory mapped here, e.g. symmetric memory's get_buffer
        # views): NoCU, else the runtime runs a blit kernel on CUs. Host memory involved:
        # Default, which ROCm runs on SDMA unless HSA_ENABLE_SDMA=0.
        return Route("hip-nocu" if dst.is_cuda and src.is_cuda else "hip-default")

    @contextlib.contextmanager
    def in_graph(self) -> Iterator[list]:
        """While a graph is captured on this device's streams: on ROCm every ``batch`` is
        added to the graph as explicit nodes (:mod:`radiance_ar.transport.hip_capture`:
        its stream capture records no stream memory operations), whose parameter arrays
        collect in the yielded list, to be kept as long as the graph. On CUDA, capture
        records the batches as they are: nothing changes."""
        kept: list = []
        if self.platform != "hip":
            yield kept
            return
        eager = self.batch, self.write_value, self.wait_value_geq, self.wait_value_eq
        self.batch = lambda stream, ops: kept.extend(hip_capture_batch(stream, ops))
        # a single stream operation would run at once, not be recorded (before ROCm 10):
        # inside a capture every operation goes through batch (GpuSignals' rounds)
        self.write_value = self.wait_value_geq = self.wait_value_eq = _not_in_hip_capture
        try:
            yield kept
        finally:
            self.batch, self.write_value, self.wait_value_geq, self.wait_value_eq = eager

    def stream(self, handle: int) -> torch.cuda.Stream:
        """A torch stream object for a raw stream handle (GPU), made once per handle:
        ``torch.cuda.current_stream`` builds a new object per call, a few microseconds
        for every event a call of the transport records."""
        found = self._streams.get(handle)
        if found is None:
            found = self._streams[handle] = stream_object(handle, self.device)
        return found

    # The stream memory operations are bound per platform at construction (below): a
    # call makes about 25 of them, and a dispatch layer per step would be host time.
    def _bind_signal_ops(self) -> None:
        if self.platform == "cuda":
            self.write_value = cuda_write_value
            self.wait_value_geq = functools.partial(cuda_wait_value, equal=False)
            self.wait_value_eq = functools.partial(cuda_wait_value, equal=True)
            self.batch = cuda_batch
        elif self.platform == "hip":
            self.write_value = hip_write_value
            self.wait_value_geq = functools.partial(hip_wait_value, equal=False)
            self.wait_value_eq = functools.partial(hip_wait_value, equal=True)
            self.batch = hip_batch
        else:
            self.write_value = self.wait_value_geq = self.wait_value_eq = _host_signals_only
            self.batch = _host_signals_only

    def device_address(self, t: torch.Tensor) -> int:
        """The address a stream operation on this device uses for ``t`` (pinned host too)."""
        if t.is_cuda or self.platform != "cuda":
            # HIP maps pinned host memory at the same address (hipHostMalloc is portable).
            return t.data_ptr()
        # Ask for the allocation's base (an interior pointer is not a registered range).
        base = t.untyped_storage().data_ptr()
        return cuda_device_pointer(base) + (t.data_ptr() - base)
