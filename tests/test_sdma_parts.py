"""Parts of the sdma backend without a world: the reduce kernel (Triton interpreter),
the copy layer's bindings (argument building, missing packages), flags and gates."""

import ctypes
import importlib.util
import struct
import sys
import types

import pytest

from interpreter import run_under_interpreter
import torch

from radiance_ar.transport import copy_engine
from radiance_ar.transport import cuda_ops, hip_ops
from radiance_ar.transport.runtime_errors import HIP_D2D_NO_CU, MASK64, BindingsMissing, CopyEngineError
from radiance_ar.transport.copy_transport import CopyTransport
from radiance_ar.backends.kernels.reduce_sum import reduce_sum, reference_reduce_sum
from radiance_ar.backends.sdma import SdmaBackend
from radiance_ar.transport.world import World


INTERPRETER_SCRIPT = r"""
import torch
from radiance_ar.backends.kernels.reduce_sum import BLOCK, reduce_sum
torch.manual_seed(0)
# The interpreter rounds fp32 -> bf16 by truncation, so bf16 inputs are summed into an
# fp32 output here (the bf16 store is checked on the GPU).
cases = [(torch.float32, torch.float32), (torch.float16, torch.float16),
         (torch.bfloat16, torch.float32)]
for n in (1, 37, BLOCK * 8, BLOCK * 8 + 37):  # aligned (fast) and generic kernels;
    # the last two need several grid-stride steps with ctas=4
    for w in (1, 2, 3, 5, 8):
        for din, dout in cases:
            xs = [(torch.randn(n) * 2.0 ** torch.randint(-8, 9, (n,))).to(din) for _ in range(w)]
            out = torch.full((n,), float("nan"), dtype=dout)
            also = torch.full((n,), float("nan"), dtype=dout)
            reduce_sum(xs, out, also, ctas=4)
            acc = xs[0].to(torch.float32)
            for x in xs[1:]:
                acc = acc + x.to(torch.float32)
            want = acc.to(dout)
            assert torch.equal(out, want) and torch.equal(also, want), (n, w, din, dout)
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_reduce_kernel_under_the_interpreter():
    run_under_interpreter(INTERPRETER_SCRIPT)


def test_reference_reduce_is_fp32_in_rank_order_rounded_once():
    a = torch.tensor([1.0, 2.0 ** 24], dtype=torch.float32)
    b = torch.tensor([2.0 ** -24, 1.0], dtype=torch.float32)
    c = torch.tensor([-1.0, -(2.0 ** 24)], dtype=torch.float32)
    out = torch.empty(2)
    reference_reduce_sum([a, b, c], out)
    assert out.tolist() == [0.0, 0.0]  # ((1 + 2^-24) - 1) in fp32 is 0; order matters
    xs = [torch.randn(64).to(torch.bfloat16) for _ in range(3)]
    o = torch.empty(64, dtype=torch.bfloat16)
    reference_reduce_sum(xs, o)
    assert torch.equal(o, (xs[0].float() + xs[1].float() + xs[2].float()).to(torch.bfloat16))


def test_reduce_arguments_are_checked():
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="1..8"):
        reduce_sum([x] * 9, torch.zeros(8))
    with pytest.raises(TypeError, match="inputs\\[1\\] dtype torch.int32"):
        reduce_sum([x, torch.zeros(8, dtype=torch.int32)], torch.zeros(8))
    with pytest.raises(ValueError, match="inputs\\[0\\] has 4 elements"):
        reference_reduce_sum([torch.zeros(4)], torch.zeros(8))
    with pytest.raises(ValueError, match="out must be contiguous"):
        reference_reduce_sum([torch.zeros(4, 4)], torch.zeros(4, 4).t())


class RecordingHip:
    """hip-python's real ``hip`` module (``pip install hip-python``: it imports without
    ROCm), its runtime calls recorded instead of made: enums, constants and error codes
    are the bindings' own. ``err`` is the hipError_t every recorded call returns."""

    CALLS = ("hipMemcpyAsync", "hipMemcpyPeerAsync", "hipStreamWriteValue64",
             "hipStreamWaitValue64", "hipStreamBatchMemOp")

    def __init__(self, err: str = "hipSuccess"):
        self.real = pytest.importorskip("hip").hip
        self.calls, self.batches = [], []
        self.err = getattr(self.real.hipError_t, err)

    def __getattr__(self, name):
        if name not in self.CALLS:
            return getattr(self.real, name)

        def call(*args):
            self.calls.append((name, args))
            if name == "hipStreamBatchMemOp":  # the array, read while the call runs
                self.batches.append(ctypes.string_at(args[2], 48 * args[1]))
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


def test_hip_batch_is_one_call_laid_out_as_the_rocm_header(monkeypatch):
    hip = RecordingHip()
    monkeypatch.setattr(hip_ops, "_hip", lambda: hip)
    ops = [("wait_eq", 0x3000, 5), ("write", 0x3000, 0), ("write", 0x3008, 2 ** 40 + 9)]
    hip_ops.hip_batch(7, ops)
    ((name, (stream, count, _, flags)),) = hip.calls
    assert (name, stream, count, flags) == ("hipStreamBatchMemOp", 7, 3, 0)
    # hipStreamBatchMemOpParams (hip_runtime_api.h): 48-byte union; operation u32 at 0,
    # address at 8, value64 at 16, flags u32 at 24. Operation codes: WaitValue64 4,
    # WriteValue64 5; wait flag hipStreamWaitValueEq 1.
    got = [struct.unpack_from("<IxxxxQQI", hip.batches[0], 48 * i) for i in range(3)]
    assert got == [(4, 0x3000, 5, 1), (5, 0x3000, 0, 0), (5, 0x3008, 2 ** 40 + 9, 0)]
    hip.calls.clear()
    hip_ops.hip_batch(7, [("write", 0x10 * i, i) for i in range(300)])  # <= 255 per call
    assert [c[1][1] for c in hip.calls] == [255, 45]
    with pytest.raises(ValueError, match="'wait_geq'"):
        hip_ops.hip_batch(7, [("wait_geq", 0x3000, 1)])


def test_hip_each_runs_each_operation_in_order(monkeypatch):
    hip = RecordingHip()
    monkeypatch.setattr(hip_ops, "_hip", lambda: hip)
    hip_ops.hip_each(7, [("wait_eq", 0x3000, 5), ("write", 0x3000, 0), ("write", 0x3008, 9)])
    assert hip.calls == [("hipStreamWaitValue64", (7, 0x3000, 5, 1, MASK64)),
                         ("hipStreamWriteValue64", (7, 0x3000, 0, 0)),
                         ("hipStreamWriteValue64", (7, 0x3008, 9, 0))]
    with pytest.raises(ValueError, match="'wait_geq'"):
        hip_ops.hip_each(7, [("wait_geq", 0x3000, 1)])


@pytest.mark.parametrize("version, says", [
    ("6.3.42131-fa1d09cbd", "ROCm 6.3: no hipStreamBatchMemOp before ROCm 6.4"),
    ("6.4.43482-0f2d60242", None), ("7.1.25424", None), ("10.0.0", None),
    (None, "runtime version None not understood"),
    ("rocm-dev", "'rocm-dev' not understood")])
def test_hip_batch_reason_names_the_runtime(version, says):
    reason = hip_ops.hip_batch_reason(version)
    assert reason is None if says is None else says in reason


@pytest.mark.parametrize("version, says", [
    ("6.4.43482-0f2d60242", "ROCm 6.4: stream capture does not record hipStreamWaitValue"),
    ("7.1.25424", "ROCm 7.1: stream capture does not record"),
    ("10.0.0", "ROCm 10.0: captured op calls are not built for ROCm yet"),
    (None, "runtime version None not understood"),
    ("rocm-dev", "'rocm-dev' not understood")])
def test_hip_capture_reason_names_the_runtime(version, says):
    assert says in hip_ops.hip_capture_reason(version)


def test_hip_errors_are_reported(monkeypatch):
    monkeypatch.setattr(hip_ops, "_hip", lambda: RecordingHip(err="hipErrorInvalidValue"))
    with pytest.raises(CopyEngineError, match="hipMemcpyPeerAsync.*hipErrorInvalidValue \\(1\\)"):
        hip_ops.hip_peer_copy(1, 1, 2, 0, 8, 0)
    with pytest.raises(CopyEngineError, match="hipStreamBatchMemOp.*hipErrorInvalidValue"):
        hip_ops.hip_batch(0, [("write", 1, 1)])


def test_hip_calls_without_rocm_say_the_runtime_could_not_be_used():
    pytest.importorskip("hip")
    if importlib.util.find_spec("torch") and torch.version.hip:
        pytest.skip("a ROCm machine: its runtime loads")
    # the real bindings, no runtime on this machine: they fail to load libamdhip64
    with pytest.raises(CopyEngineError, match="HIP runtime could not be used.*libamdhip64"):
        hip_ops.hip_write_value(0, 1, 1)
    with pytest.raises(CopyEngineError, match="hipStreamBatchMemOp.*libamdhip64"):
        hip_ops.hip_batch(0, [("write", 1, 1)])


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
        with pytest.raises(ValueError, match="'wait_geq'"):
            cuda_ops.cuda_batch(7, [("wait_geq", 0x4000, 1)])
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
        wait, write = cuda_ops.cuda_batch_params([("wait_eq", 0x2000, 2 ** 33 + 7),
                                                  ("write", 0x2000, 0)])
        assert wait.operation.name == "CU_STREAM_MEM_OP_WAIT_VALUE_32"
        assert (int(wait.waitValue.address), int(wait.waitValue.value)) == (0x2000, 7)
        assert wait.waitValue.flags == 1  # CU_STREAM_WAIT_VALUE_EQ
        assert write.operation.name == "CU_STREAM_MEM_OP_WRITE_VALUE_32"
        assert (int(write.writeValue.address), int(write.writeValue.value)) == (0x2000, 0)
    finally:
        cuda_ops._cuda_calls.cache_clear()


def test_missing_bindings_name_the_pip_package(monkeypatch):
    # The package and its submodule: an earlier import of cuda-python leaves both cached.
    for name in ("cuda", "cuda.bindings", "hip"):
        monkeypatch.setitem(sys.modules, name, None)
    cuda_ops._cuda_calls.cache_clear()
    with pytest.raises(BindingsMissing, match="pip install cuda-python"):
        cuda_ops.cuda_copy(0, 0, 8, 0)
    with pytest.raises(BindingsMissing, match="pip install hip-python"):
        hip_ops.hip_copy(0, 0, 8, 0, no_cu=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    world = World(0, 2, torch.device("cuda", 0), _Mem("gpu-emulated"))
    reason = SdmaBackend.unsupported_reason(world)
    assert reason is not None and ("cuda-python" in reason or "hip-python" in reason)
    with pytest.raises(ValueError, match="cannot run here.*pip install"):
        SdmaBackend(world)


class _Mem:
    def __init__(self, kind):
        self.kind = kind


def test_gates():
    cpu = torch.device("cpu")
    assert SdmaBackend.unsupported_reason(World(0, 2, cpu, _Mem("cpu-shm"))) is None
    assert SdmaBackend.unsupported_reason(World(0, 1, cpu, _Mem("single"))) is None
    assert "unknown to sdma" in SdmaBackend.unsupported_reason(World(0, 2, cpu, _Mem("tcp")))
    assert "input limit" in SdmaBackend.unsupported_reason(World(0, 9, cpu, _Mem("cpu-shm")))
    assert "needs a CUDA/ROCm device" in SdmaBackend.unsupported_reason(
        World(0, 2, cpu, _Mem("gpu-symm")))


def test_cpu_copy_counts_bytes():
    eng = copy_engine.CopyEngine(torch.device("cpu"))
    src, dst = torch.arange(12, dtype=torch.int16), torch.zeros(24, dtype=torch.uint8)
    assert eng.copy(dst, src, 0) == 24 and torch.equal(dst.view(torch.int16), src)
    with pytest.raises(ValueError, match="dst has 24 B but src has 8 B"):
        eng.copy(dst, torch.zeros(8, dtype=torch.uint8), 0)


def test_copy_bytes_moves_exactly_the_addressed_span():
    # The transport's pulls are address arithmetic on a route decided once per buffer pair.
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.full((64,), 255, dtype=torch.uint8)
    how = copy_engine.CopyEngine(torch.device("cpu")).route(dst, src)
    assert how == copy_engine.Route("cpu")
    copy_engine.copy_bytes(dst.data_ptr() + 8, src.data_ptr() + 20, 16, 0, how)
    want = torch.full((64,), 255, dtype=torch.uint8)
    want[8:24] = src[20:36]
    assert torch.equal(dst, want)


def test_resync_is_refused_in_a_gpu_symm_world():
    # Device-memory flags: a stream blocked on a missing peer cannot be released, so a
    # resync there would wait forever; every rank refuses alike (by world kind).
    tr = CopyTransport.__new__(CopyTransport)  # the transport of sdma and sdma_wht6
    tr.world = World(0, 2, torch.device("cuda", 0), memory=None)
    tr.world.memory = type("Symm", (), {"kind": "gpu-symm"})()
    tr.signals, tr.owner = object(), "sdma"
    with pytest.raises(RuntimeError, match="sdma.resync: not possible in a gpu-symm world"
                                           ".*restart the job"):
        tr.resync()


def test_passive_peer_fill_repeats_the_payload_into_every_other_rank_only():
    from radiance_ar.transport import passive_peers
    from radiance_ar.transport.peer_memory import PeerBuffer

    payload = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)  # 6 bytes
    fill = passive_peers.repeated_bytes(payload, 16)
    raw = payload.view(torch.uint8)
    assert fill.dtype == torch.uint8 and fill.numel() == 16
    assert torch.equal(fill, torch.cat([raw, raw, raw[:4]]))
    peers = [torch.zeros(40, dtype=torch.uint8) for _ in range(3)]
    passive_peers.fill_other_ranks(PeerBuffer("b", 40, 1, peers), 1, fill, (0, 20))
    for r, buf in enumerate(peers):
        want = (torch.zeros(40, dtype=torch.uint8) if r == 1 else
                torch.cat([fill, torch.zeros(4, dtype=torch.uint8), fill, torch.zeros(4, dtype=torch.uint8)]))
        assert torch.equal(buf, want), r
    with pytest.raises(ValueError, match="payload is empty"):
        passive_peers.repeated_bytes(torch.empty(0), 8)


def test_fast_launch_keys_apart_everything_triton_specializes_on():
    from radiance_ar.launch.fast_launch import _arg_class
    from radiance_ar.launch.pointers import Address

    ints = [1, 2, 15, 16, 32, 2 ** 31 - 16, 2 ** 31, -(2 ** 31), -(2 ** 31) - 16, 2 ** 63]
    classes = [_arg_class(v) for v in ints]
    # 1 alone; multiples of 16 apart from the rest; i32, i64 and u64 apart
    assert classes[0] != classes[1] and classes[1] == classes[2]
    assert classes[3] == classes[4] == classes[5] != classes[2]
    assert classes[6] != classes[5] and classes[7] == classes[5] and classes[8] != classes[7]
    assert classes[9] != classes[6] and classes[9] != classes[5]
    # a constexpr parameter is specialized on its value
    assert _arg_class(1024, constexpr=True) != _arg_class(2048, constexpr=True)
    aligned, odd = Address(1 << 20, torch.bfloat16), Address((1 << 20) + 2, torch.bfloat16)
    assert _arg_class(aligned) != _arg_class(odd)
    assert _arg_class(aligned) != _arg_class(Address(1 << 20, torch.float16))
    t = torch.zeros(8, dtype=torch.bfloat16)
    assert _arg_class(t) == _arg_class(Address(t.data_ptr(), t.dtype))
    assert _arg_class(True) != _arg_class(1) and _arg_class(True) != _arg_class(False)
    assert _arg_class(0.5) != _arg_class(1.5)


def test_a_default_stream_call_runs_on_the_transports_own_stream(monkeypatch):
    """CopyTransport.call_stream's GPU branch with stand-in streams (no GPU here): for a
    caller on the default stream (handle 0) the steps go to the own stream, which first
    waits for the caller, is current meanwhile, and the caller waits for it after, also
    when the call raises. Another handle is used as it is."""
    from radiance_ar.transport import copy_transport

    log = []

    class FakeStream:
        def __init__(self, name, handle):
            self.name, self.cuda_stream = name, handle

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    default, own = FakeStream("default", 0), FakeStream("own", 0x77)

    class FakeContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"current {self.stream.name}")

        def __exit__(self, *exc):
            log.append(f"current back from {self.stream.name}")

    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "stream", FakeContext)
    handle = [0]
    monkeypatch.setattr(copy_transport, "current_stream_handle", lambda device: handle[0])

    class FakeWorld:
        device = torch.device("cuda", 0)

    class FakeTransport:
        world, _own_stream = FakeWorld(), own
        call_stream = copy_transport.CopyTransport.call_stream

    tr = FakeTransport()
    with tr.call_stream() as stream:
        log.append(f"steps on {stream:#x}")
    assert log == ["own waits default", "current own", "steps on 0x77",
                   "current back from own", "default waits own"]
    log.clear()
    with pytest.raises(RuntimeError, match="boom"):
        with tr.call_stream():
            raise RuntimeError("boom")
    assert log[-1] == "default waits own"
    log.clear()
    handle[0] = 0x55
    with tr.call_stream() as stream:
        assert stream == 0x55
    assert log == []

