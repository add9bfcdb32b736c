"""NVIDIA: copies and stream memory operations through cuda-python, resolved once.

``cudaMemcpyAsync`` (kind Default: unified addressing picks H2D, D2H or P2P, all on copy
engines) and ``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` (GEQ or EQ), executed by
the GPU's front end: no kernel spins. The bindings are imported at the first call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from radiance_ar.transport.runtime_errors import MASK32, BindingsMissing, CopyEngineError


def _cuda() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime
    except ImportError as e:
        raise BindingsMissing(
            "the sdma copy layer on NVIDIA needs the CUDA Python bindings: "
            f"pip install cuda-python (import failed: {e})") from None
    return driver, runtime


@dataclass(frozen=True)
class _CudaCalls:
    """The bound entry points and enum values of the per-step calls, resolved once: an
    sdma slice makes about 25 of these calls, and an import statement plus three enum
    lookups per call is a measurable share of its host time (radiance_ar.diagnostics.host_cost)."""
    memcpy: Any
    memcpy_default: Any
    write32: Any
    write_default: Any
    wait32: Any
    wait_eq: Any
    wait_geq: Any
    batch: Any
    batch_params: Any
    op_write: Any
    op_wait: Any


@functools.cache
def _cuda_calls() -> _CudaCalls:
    driver, runtime = _cuda()
    wait = driver.CUstreamWaitValue_flags
    return _CudaCalls(runtime.cudaMemcpyAsync, runtime.cudaMemcpyKind.cudaMemcpyDefault,
                      driver.cuStreamWriteValue32,
                      driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
                      driver.cuStreamWaitValue32, wait.CU_STREAM_WAIT_VALUE_EQ,
                      wait.CU_STREAM_WAIT_VALUE_GEQ, driver.cuStreamBatchMemOp,
                      driver.CUstreamBatchMemOpParams,
                      driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32,
                      driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32)


def _cuda_ok(result: tuple, call: str) -> tuple:
    err = result[0]
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise CopyEngineError(f"{call} failed: {name} ({int(err)})")
    return result[1:]


def cuda_copy(dst_ptr: int, src_ptr: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` of ``nbytes``; kind Default lets UVA pick H2D / D2H / P2P."""
    api = _cuda_calls()
    _cuda_ok(api.memcpy(dst_ptr, src_ptr, nbytes, api.memcpy_default, stream),
             f"cudaMemcpyAsync({nbytes} B)")


def cuda_write_value(stream: int, addr: int, value: int) -> None:
    """``*addr = value`` (low 32 bits) once all earlier work of ``stream`` is done.

    The default flag keeps the memory barrier: earlier writes of the stream (the copy
    that published a slice) are visible before the flag.
    """
    api = _cuda_calls()
    _cuda_ok(api.write32(stream, addr, value & MASK32, api.write_default), "cuStreamWriteValue32")


def cuda_wait_value(stream: int, addr: int, value: int, *, equal: bool) -> None:
    """Later work of ``stream`` waits until the 32-bit word at ``addr`` equals ``value``
    (``equal``) or reaches it (``(int32)(*addr - value) >= 0``, a cyclic GEQ)."""
    api = _cuda_calls()
    _cuda_ok(api.wait32(stream, addr, value & MASK32, api.wait_eq if equal else api.wait_geq),
             "cuStreamWaitValue32")


def cuda_device_pointer(host_ptr: int) -> int:
    """The device address of pinned host memory (equal to ``host_ptr`` under UVA)."""
    _, runtime = _cuda()
    (dev_ptr,) = _cuda_ok(runtime.cudaHostGetDevicePointer(host_ptr, 0),
                          "cudaHostGetDevicePointer")
    return int(dev_ptr)


#: cuStreamBatchMemOp takes fewer than 256 operations per call
BATCH_MAX_OPS = 255


def cuda_batch_params(ops: list[tuple[str, int, int]]) -> list:
    """The ``CUstreamBatchMemOpParams`` of ``ops``: ``("write", addr, value)`` (default
    flags: earlier writes of the stream are visible first), ``("wait_eq", addr, value)`` or
    ``("wait_geq", addr, value)`` (cyclic: ``(int32)(*addr - value) >= 0``)."""
    api = _cuda_calls()
    params = []
    for what, addr, value in ops:
        p = api.batch_params()
        if what == "write":
            p.writeValue.operation = api.op_write
            p.writeValue.address = addr
            p.writeValue.value = value & MASK32
            p.writeValue.flags = api.write_default
        elif what in ("wait_eq", "wait_geq"):
            p.waitValue.operation = api.op_wait
            p.waitValue.address = addr
            p.waitValue.value = value & MASK32
            p.waitValue.flags = api.wait_eq if what == "wait_eq" else api.wait_geq
        else:
            raise ValueError(f"cuda_batch_params: operation {what!r}: expected 'write', "
                             "'wait_eq' or 'wait_geq'")
        params.append(p)
    return params


def cuda_batch(stream: int, ops: list[tuple[str, int, int]]) -> None:
    """``ops`` (see :func:`cuda_batch_params`) in one ``cuStreamBatchMemOp``, in order.

    Why batched: in a captured op call every operation is a graph node, and a graph's
    launch costs the host per node; a token post to W-1 peers, or a wait and its reset,
    become one node instead of W-1 or two.
    """
    api = _cuda_calls()
    for lo in range(0, len(ops), BATCH_MAX_OPS):
        chunk = cuda_batch_params(ops[lo:lo + BATCH_MAX_OPS])
        _cuda_ok(api.batch(stream, len(chunk), chunk, 0), f"cuStreamBatchMemOp({len(chunk)} ops)")


def cuda_relax_capture_mode() -> None:
    """Let the calling thread query events while another thread captures a graph in the
    default (global) mode, which otherwise refuses that thread's query and invalidates the
    capture (what torch's NCCL watchdog thread does, pytorch#104555): the watchdog's."""
    _, runtime = _cuda()
    _cuda_ok(runtime.cudaThreadExchangeStreamCaptureMode(
        runtime.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
        "cudaThreadExchangeStreamCaptureMode")


#: cudaHostRegisterPortable | cudaHostRegisterMapped (cuda_runtime_api.h): every context
#: of the process sees the pages as pinned, at a device address (UVA: the host address)
CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02


def cuda_host_register(host_ptr: int, nbytes: int) -> None:
    """``cudaHostRegister`` (portable, mapped): pin ``nbytes`` at ``host_ptr`` (a mapping of
    this process) for copy engines, kernels and stream memory operations."""
    _, runtime = _cuda()
    _cuda_ok(runtime.cudaHostRegister(host_ptr, nbytes, CUDA_HOST_REGISTER_FLAGS),
             f"cudaHostRegister({nbytes} B)")


def cuda_host_unregister(host_ptr: int) -> None:
    """``cudaHostUnregister``: unpin what :func:`cuda_host_register` pinned at ``host_ptr``."""
    _, runtime = _cuda()
    _cuda_ok(runtime.cudaHostUnregister(host_ptr), "cudaHostUnregister")
