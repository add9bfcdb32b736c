"""The copy layer's runtime calls against the real bindings, without a GPU: hip-python and
cuda-bindings import without their runtimes, so each call is built with the bindings' own
enums and structs and recorded instead of made (argument order, codes); and what a machine
without the runtime reports."""

import importlib.util

import pytest
import torch

from radiance_ar.transport import cuda_ops, hip_ops
from radiance_ar.transport.runtime_errors import HIP_D2D_NO_CU, MASK64, CopyEngineError


class RecordingHip:
    """hip-python's real ``hip`` module (``pip install hip-python``: it imports without
    ROCm), its runtime calls recorded instead of made: enums, constants and error codes
    are the bindings' own. ``err`` is the hipError_t every recorded call returns."""

    CALLS = ("hipMemcpyAsync", "hipMemcpyPeerAsync", "hipStreamWriteValue64",
             "hipStreamWaitValue64")

    def __init__(self, err: str = "hipSuccess"):
        self.real = pytest.importorskip("hip").hip
        self.calls = []
        self.err = getattr(self.real.hipError_t, err)

    def __getattr__(self, name):
        if name not in self.CALLS:
            return getattr(self.real, name)

        def call(*args):
            self.calls.append((name, args))
            return (self.err,)
        return call


def test_hip_calls_are_built_against_the_real_api(monkeypatch):
    hip = RecordingHip()
    monkeypatch.setattr(hip_ops, "_hip", lambda: hip)
    hip_ops.hip_copy(0x1000, 0x2000, 64, 7, no_cu=True)
    hip_ops.hip_copy(0x1000, 0x2000, 64, 7, no_cu=False)
    hip_ops.hip_peer_copy(0x1000, 1, 0x2000, 0, 64, 7)
    hip_ops.hip_write_value(7, 0x3000, 5)
    hip_ops.hip_wait_value(7, 0x3000, 5, equal=False)
    hip_ops.hip_wait_value(7, 0x3000, 6, equal=True)
    names = [c[0] for c in hip.calls]
    assert names == ["hipMemcpyAsync", "hipMemcpyAsync", "hipMemcpyPeerAsync",
                     "hipStreamWriteValue64", "hipStreamWaitValue64", "hipStreamWaitValue64"]
    # the codes of hip_runtime_api.h: hipMemcpyDeviceToDeviceNoCU 1024, hipMemcpyDefault 4,
    # hipStreamWaitValueGte 0, hipStreamWaitValueEq 1
    assert hip.calls[0][1][3].value == HIP_D2D_NO_CU == 1024
    assert hip.calls[1][1][3].value == 4
    assert hip.calls[2][1] == (0x1000, 1, 0x2000, 0, 64, 7)
    assert hip.calls[3][1] == (7, 0x3000, 5, 0)
    assert hip.calls[4][1] == (7, 0x3000, 5, 0, MASK64)
    assert hip.calls[5][1] == (7, 0x3000, 6, 1, MASK64)


def test_hip_batch_runs_each_operation_in_order(monkeypatch):
    hip = RecordingHip()
    monkeypatch.setattr(hip_ops, "_hip", lambda: hip)
    hip_ops.hip_batch(7, [("wait_eq", 0x3000, 5), ("write", 0x3000, 0), ("write", 0x3008, 9),
                          ("wait_geq", 0x3010, 4)])
    assert hip.calls == [("hipStreamWaitValue64", (7, 0x3000, 5, 1, MASK64)),
                         ("hipStreamWriteValue64", (7, 0x3000, 0, 0)),
                         ("hipStreamWriteValue64", (7, 0x3008, 9, 0)),
                         ("hipStreamWaitValue64", (7, 0x3010, 4, 0, MASK64))]  # Gte
    with pytest.raises(ValueError, match="'wait_lt'"):
        hip_ops.hip_batch(7, [("wait_lt", 0x3000, 1)])


def test_hip_errors_are_reported(monkeypatch):
    monkeypatch.setattr(hip_ops, "_hip", lambda: RecordingHip(err="hipErrorInvalidValue"))
    with pytest.raises(CopyEngineError, match="hipMemcpyPeerAsync.*hipErrorInvalidValue \\(1\\)"):
        hip_ops.hip_peer_copy(1, 1, 2, 0, 8, 0)
    with pytest.raises(CopyEngineError, match="hipStreamWriteValue64.*hipErrorInvalidValue"):
        hip_ops.hip_batch(0, [("write", 1, 1)])


def test_hip_calls_without_rocm_say_the_runtime_could_not_be_used():
    pytest.importorskip("hip")
    if importlib.util.find_spec("torch") and torch.version.hip:
        pytest.skip("a ROCm machine: its runtime loads")
    # the real bindings, no runtime on this machine: they check each call's arguments
    # (count and types: a TypeError here would be a call built wrong), then fail to load
    # libamdhip64
    hip_ops.hip_runtime_version.cache_clear()
    calls = [lambda: hip_ops.hip_copy(1 << 20, 2 << 20, 64, 7, no_cu=True),
             lambda: hip_ops.hip_copy(1 << 20, 2 << 20, 64, 0, no_cu=False),
             lambda: hip_ops.hip_peer_copy(1 << 20, 1, 2 << 20, 0, 64, 7),
             lambda: hip_ops.hip_write_value(7, 1 << 20, 3),
             lambda: hip_ops.hip_wait_value(7, 1 << 20, 3, equal=True),
             lambda: hip_ops.hip_wait_value(7, 1 << 20, 3, equal=False),
             lambda: hip_ops.hip_batch(7, [("write", 1 << 20, 1), ("wait_geq", 2 << 20, 2),
                                           ("wait_eq", 3 << 20, 3)]),
             lambda: hip_ops.hip_host_register(1 << 20, 4096),
             lambda: hip_ops.hip_host_unregister(1 << 20),
             lambda: hip_ops.hip_device_pointer(1 << 20),
             hip_ops.hip_runtime_version,
             hip_ops.hip_relax_capture_mode]
    for call in calls:
        with pytest.raises(CopyEngineError, match="HIP runtime could not be used.*libamdhip64"):
            call()
    hip_ops.hip_runtime_version.cache_clear()


def test_the_relaxed_capture_mode_is_set_in_the_one_hip_runtime_mapped():
    """hip_relax_capture_mode calls the runtime through ctypes: the copy mapped in the
    process (hip-python's and torch's), found in /proc/self/maps; none or two copies raise."""
    line = "7f00-7f10 r-xp 00000000 08:01 42 {}"
    one = "\n".join([line.format("/opt/rocm-6.4.1/lib/libamdhip64.so.6.4.60401"),
                     line.format("/opt/rocm-6.4.1/lib/libamdhip64.so.6.4.60401"),
                     line.format("/usr/lib/libc.so.6"), "7f20-7f30 rw-p 00000000 00:00 0"])
    assert hip_ops.mapped_library("libamdhip64", one) == "/opt/rocm-6.4.1/lib/libamdhip64.so.6.4.60401"
    two = one + "\n" + line.format("/home/u/rocm/lib/libamdhip64.so.7")
    with pytest.raises(CopyEngineError, match="expected one copy of the HIP runtime.*found 2"):
        hip_ops.mapped_library("libamdhip64", two)
    with pytest.raises(CopyEngineError, match="found 0"):
        hip_ops.mapped_library("libamdhip64", line.format("/usr/lib/libc.so.6"))


class RecordingCuda:
    """A real cuda-bindings module (``driver`` or ``runtime``: they import without a GPU)
    whose runtime calls in ``CALLS`` are recorded instead of made (CUresult tuples)."""

    CALLS = ("cudaMemcpyAsync", "cuStreamWriteValue32", "cuStreamWaitValue32",
             "cuStreamBatchMemOp")

    def __init__(self, real, calls, err=0):
        self.real, self.calls, self.err = real, calls, err

    def __getattr__(self, name):
        if name not in self.CALLS:
            return getattr(self.real, name)

        def call(*args):
            self.calls.append((name, args))
            result = self.real.cudaError_t if hasattr(self.real, "cudaError_t") else self.real.CUresult
            return (result(self.err),)
        return call


def test_cuda_calls_are_built_against_the_real_api(monkeypatch):
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver, runtime
    calls = []
    rec_driver, rec_runtime = RecordingCuda(driver, calls), RecordingCuda(runtime, calls)
    monkeypatch.setattr(cuda_ops, "_cuda", lambda: (rec_driver, rec_runtime))
    cuda_ops._cuda_calls.cache_clear()  # the entry points are resolved once, then kept
    try:
        cuda_ops.cuda_copy(0x1000, 0x2000, 64, 7)
        cuda_ops.cuda_write_value(7, 0x3000, 2 ** 32 + 5)
        cuda_ops.cuda_wait_value(7, 0x3000, 5, equal=False)
        cuda_ops.cuda_wait_value(7, 0x3000, 6, equal=True)
        assert [c[0] for c in calls] == ["cudaMemcpyAsync", "cuStreamWriteValue32",
                                         "cuStreamWaitValue32", "cuStreamWaitValue32"]
        # cuda_runtime_api.h / cuda.h codes: cudaMemcpyDefault 4, CU_STREAM_WAIT_VALUE_GEQ
        # 0 and _EQ 1, CU_STREAM_WRITE_VALUE_DEFAULT 0
        assert calls[0][1][:3] == (0x1000, 0x2000, 64) and calls[0][1][3] == 4
        assert calls[0][1][4] == 7
        assert calls[1][1] == (7, 0x3000, 5, 0)  # the low 32 bits only
        assert calls[2][1] == (7, 0x3000, 5, 0) and calls[3][1] == (7, 0x3000, 6, 1)
        # 300 operations: two calls (fewer than 256 each), in order, values cut to 32 bits
        ops = [("wait_eq", 0x4000 + 8 * i, 2 ** 32 + i) if i % 2 else ("write", 0x4000 + 8 * i, i)
               for i in range(300)]
        cuda_ops.cuda_batch(7, ops)
        batches = [c[1] for c in calls[4:]]
        assert [(b[0], b[1], len(b[2]), b[3]) for b in batches] == [(7, 255, 255, 0), (7, 45, 45, 0)]
        params = batches[0][2] + batches[1][2]
        for (what, addr, value), p in zip(ops, params):
            v = p.writeValue if what == "write" else p.waitValue
            # CU_STREAM_MEM_OP_WAIT_VALUE_32 1, CU_STREAM_MEM_OP_WRITE_VALUE_32 2
            assert (int(v.operation), int(v.address), int(v.value), int(v.flags)) == (
                (2, addr, value, 0) if what == "write" else (1, addr, value - 2 ** 32, 1))
        with pytest.raises(ValueError, match="'wait_lt'"):
            cuda_ops.cuda_batch(7, [("wait_lt", 0x4000, 1)])
        rec_driver.err = 1
        with pytest.raises(CopyEngineError, match="cuStreamWaitValue32 failed.*INVALID_VALUE"):
            cuda_ops.cuda_wait_value(7, 0x3000, 6, equal=True)
    finally:
        cuda_ops._cuda_calls.cache_clear()


def test_cuda_batch_params_with_the_real_bindings():
    """The batch's parameter structs as the installed cuda-bindings builds them (no GPU
    needed to build them): one wait and its reset, in order."""
    pytest.importorskip("cuda.bindings")
    cuda_ops._cuda_calls.cache_clear()
    try:
        wait, write, geq = cuda_ops.cuda_batch_params([("wait_eq", 0x2000, 2 ** 33 + 7),
                                                       ("write", 0x2000, 0),
                                                       ("wait_geq", 0x2008, 3)])
        assert wait.operation.name == "CU_STREAM_MEM_OP_WAIT_VALUE_32"
        assert (int(wait.waitValue.address), int(wait.waitValue.value)) == (0x2000, 7)
        assert wait.waitValue.flags == 1  # CU_STREAM_WAIT_VALUE_EQ
        assert geq.operation.name == "CU_STREAM_MEM_OP_WAIT_VALUE_32"
        assert (int(geq.waitValue.address), int(geq.waitValue.value)) == (0x2008, 3)
        assert geq.waitValue.flags == 0  # CU_STREAM_WAIT_VALUE_GEQ
        assert write.operation.name == "CU_STREAM_MEM_OP_WRITE_VALUE_32"
        assert (int(write.writeValue.address), int(write.writeValue.value)) == (0x2000, 0)
    finally:
        cuda_ops._cuda_calls.cache_clear()
