"""ROCm: copies and stream memory operations through hip-python.

``hipMemcpyAsync`` (kind NoCU for same-device views of peer memory, else Default, which
ROCm runs on SDMA engines for host memory), ``hipMemcpyPeerAsync`` across devices, and
``hipStreamWriteValue64`` / ``hipStreamWaitValue64``. Written against the real bindings
(hip-python imports without ROCm; each call reports a runtime that cannot load).

clr (ROCm's runtime; read in its source, rocvirtual.cpp and rocblit.cpp, not run here) runs
a stream wait as a blit kernel of one work-item that polls the word on a compute unit,
unless ``GPU_STREAMOPS_CP_WAIT=1``, which makes it a barrier-value packet of the command
processor but needs the word in signal memory (``hipMallocSignalMemory``; these flags are
symmetric or host memory); a write is always such a kernel. So on ROCm a waiting call
holds one wave slot per wait, not the spin-wait AR's CTAs, and not none.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from radiance_ar.transport.runtime_errors import MASK64, BindingsMissing, CopyEngineError


def _hip() -> Any:
    try:
        from hip import hip
    except ImportError as e:
        raise BindingsMissing(
            "the sdma copy layer on ROCm needs the ROCm Python bindings: "
            f"pip install hip-python (import failed: {e})") from None
    return hip


def _hip_ok(call: str, fn: Any, *args: Any) -> tuple:
    try:
        result = fn(*args)
    except RuntimeError as e:  # hip-python raises when libamdhip64 cannot be loaded
        raise CopyEngineError(f"{call}: the HIP runtime could not be used: {e}") from None
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise CopyEngineError(f"{call} failed: {name} ({int(err)})")
    return result[1:] if isinstance(result, tuple) else ()


@functools.cache
def hip_runtime_version() -> str:
    """The loaded HIP runtime's version as ``"major.minor"`` (``hipRuntimeGetVersion``:
    major * 10_000_000 + minor * 100_000 + patch), what its graph features depend on;
    ``torch.version.hip`` is what torch was built against, not what runs."""
    hip = _hip()
    (version,) = _hip_ok("hipRuntimeGetVersion", hip.hipRuntimeGetVersion)
    return f"{version // 10_000_000}.{version // 100_000 % 100}"


def hip_copy(dst_ptr: int, src_ptr: int, nbytes: int, stream: int, *, no_cu: bool) -> None:
    """``hipMemcpyAsync``: kind NoCU (same-device views of peer memory) or Default (host)."""
    hip = _hip()
    kind = (hip.hipMemcpyKind.hipMemcpyDeviceToDeviceNoCU if no_cu
            else hip.hipMemcpyKind.hipMemcpyDefault)
    _hip_ok(f"hipMemcpyAsync({nbytes} B, {kind.name})", hip.hipMemcpyAsync,
            dst_ptr, src_ptr, nbytes, kind, stream)


def hip_peer_copy(dst_ptr: int, dst_device: int, src_ptr: int, src_device: int, nbytes: int,
                  stream: int) -> None:
    """``hipMemcpyPeerAsync`` between two devices (SDMA above ROC_P2P_SDMA_SIZE, 1 MiB)."""
    hip = _hip()
    _hip_ok(f"hipMemcpyPeerAsync({nbytes} B, {src_device}->{dst_device})",
            hip.hipMemcpyPeerAsync, dst_ptr, dst_device, src_ptr, src_device, nbytes, stream)


def hip_write_value(stream: int, addr: int, value: int) -> None:
    """``*addr = value`` (64-bit) after all earlier work of ``stream``."""
    hip = _hip()
    _hip_ok("hipStreamWriteValue64", hip.hipStreamWriteValue64, stream, addr, value & MASK64, 0)


def hip_wait_value(stream: int, addr: int, value: int, *, equal: bool) -> None:
    """Later work of ``stream`` waits until ``*addr == value`` (``equal``) or
    ``*addr >= value`` (64-bit: never wraps)."""
    hip = _hip()
    _hip_ok("hipStreamWaitValue64", hip.hipStreamWaitValue64, stream, addr, value & MASK64,
            int(hip.hipStreamWaitValueEq if equal else hip.hipStreamWaitValueGte), MASK64)


def hip_batch(stream: int, ops: list[tuple[str, int, int]]) -> None:
    """``ops`` (``("write", addr, value)`` / ``("wait_eq" | "wait_geq", addr, value)``) in
    order, one call each: an eager call's batch (a one-work-item kernel each, the module
    doc). Not ``hipStreamBatchMemOp`` (ROCm 6.4+, beta), which would be one kernel for all
    of them, for what clr's source shows: its argument check rejected every call until a
    fix of 2026-02 (``operation == Barrier || FlushRemoteWrites``, always true), after
    ROCm 7.2.0 shipped; before ROCm 10 it ran a batch's operations concurrently, one
    work-item each; and it writes with no release barrier first, unlike
    ``hipStreamWriteValue``. Inside a capture a batch is graph nodes instead
    (:func:`radiance_ar.transport.hip_capture.hip_capture_batch`)."""
    for what, addr, value in ops:
        if what == "write":
            hip_write_value(stream, addr, value)
        elif what in ("wait_eq", "wait_geq"):
            hip_wait_value(stream, addr, value, equal=what == "wait_eq")
        else:
            raise ValueError(f"hip_batch: operation {what!r}: expected 'write', 'wait_eq' "
                             "or 'wait_geq'")


#: hipHostRegisterPortable | hipHostRegisterMapped (hip_runtime_api.h)
HIP_HOST_REGISTER_FLAGS = 0x01 | 0x02


def hip_relax_capture_mode() -> None:
    """As :func:`radiance_ar.transport.cuda_ops.cuda_relax_capture_mode`, on ROCm.
    hip-python binds ``hipThreadExchangeStreamCaptureMode`` with no argument (it only reads
    the thread's mode), so the runtime itself is called, through ctypes."""
    relaxed = ctypes.c_int(int(_hip().hipStreamCaptureMode.hipStreamCaptureModeRelaxed))
    hip_runtime_version()  # hip-python has loaded its runtime: the one mapped now
    with open("/proc/self/maps") as maps:
        path = mapped_library("libamdhip64", maps.read())
    try:
        runtime = ctypes.CDLL(path)
    except OSError as e:
        raise CopyEngineError(f"hipThreadExchangeStreamCaptureMode: the HIP runtime could not "
                              f"be loaded: {e}") from None
    err = runtime.hipThreadExchangeStreamCaptureMode(ctypes.byref(relaxed))
    if err != 0:
        raise CopyEngineError(f"hipThreadExchangeStreamCaptureMode failed: hipError_t {err}")


def mapped_library(stem: str, maps: str) -> str:
    """The path of the one library named ``stem*`` in ``maps`` (``/proc/self/maps``), else
    ``CopyEngineError``: a call through another copy than the one hip-python and torch run
    (another ROCm on the loader's path) would change nothing of theirs, and two copies
    mapped give torch's stream handles to a runtime that does not know them."""
    paths = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rsplit("/", 1)[-1].startswith(stem):
            paths.add(fields[5].strip())
    if len(paths) != 1:
        raise CopyEngineError(f"{stem}: expected one copy of the HIP runtime in this process, "
                              f"found {len(paths)}: {sorted(paths)}")
    return paths.pop()


def hip_host_register(host_ptr: int, nbytes: int) -> None:
    """``hipHostRegister`` (portable, mapped): pin ``nbytes`` at ``host_ptr``."""
    hip = _hip()
    _hip_ok(f"hipHostRegister({nbytes} B)", hip.hipHostRegister, host_ptr, nbytes,
            HIP_HOST_REGISTER_FLAGS)


def hip_host_unregister(host_ptr: int) -> None:
    """``hipHostUnregister``: unpin what :func:`hip_host_register` pinned at ``host_ptr``."""
    hip = _hip()
    _hip_ok("hipHostUnregister", hip.hipHostUnregister, host_ptr)


def hip_device_pointer(host_ptr: int) -> int:
    """The device address of registered host memory (``hipHostGetDevicePointer``)."""
    hip = _hip()
    (dev_ptr,) = _hip_ok("hipHostGetDevicePointer", hip.hipHostGetDevicePointer, host_ptr, 0)
    return int(dev_ptr)
