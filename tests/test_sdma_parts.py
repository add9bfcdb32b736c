"""Parts of the sdma backend without a world: the reduce kernel (Triton interpreter),
missing bindings, flags and gates (the bindings' calls: test_copy_bindings.py)."""

import contextlib
import importlib.util
import sys

import pytest

from interpreter import run_under_interpreter
import torch

from radiance_ar.transport import copy_engine
from radiance_ar.transport import cuda_ops, hip_ops
from radiance_ar.transport.runtime_errors import BindingsMissing
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
    with pytest.raises(TypeError, match="also dtype torch.float32 must match out's torch.float16"):
        reference_reduce_sum([x], torch.zeros(8, dtype=torch.float16), torch.zeros(8))


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


def test_fast_launch_keys_rocm_tensors_apart_by_storage_span_as_triton_does(monkeypatch):
    """Triton's AMD backend compiles 32-bit buffer offsets for a tensor whose storage spans
    at most 2 GiB - 1 bytes (HIPBackend.get_tensor_specialization's "S"): a variant of a
    small tensor must never serve a larger one. Triton's own specializer is the reference
    (meta tensors: no memory)."""
    from triton.backends.amd.compiler import HIPBackend

    from radiance_ar.launch import fast_launch
    from radiance_ar.launch.pointers import Address

    small = torch.empty(1024, dtype=torch.uint8, device="meta")
    large = torch.empty(2 ** 31 + 1024, dtype=torch.uint8, device="meta")
    view = large[:1024]  # a small view of a large storage is keyed by its storage
    spec = [HIPBackend.get_tensor_specialization(t, align=True) for t in (small, large, view)]
    assert spec[0] != spec[1] == spec[2]
    monkeypatch.setattr(fast_launch, "_KEY_STORAGE_SPAN", True)  # as on ROCm
    keys = [fast_launch._arg_class(t) for t in (small, large, view)]
    assert keys[0] != keys[1] == keys[2]
    # an address has no storage: Triton never gives it "S", nor may the key share the
    # small tensor's variant with it
    assert HIPBackend.get_tensor_specialization(Address(0, torch.uint8), align=True) == spec[1]
    assert fast_launch._arg_class(Address(0, torch.uint8)) != keys[0]


def test_a_default_stream_call_runs_on_the_transports_own_stream(monkeypatch):
    """CopyTransport.call_stream's GPU branch (call_streams.OwnStream) with stand-in
    streams (no GPU here): for a caller on the default stream (handle 0) the steps go to
    the own stream, made at the first such call, which first waits for the caller, is
    current meanwhile, and the caller waits for it after, also when the call raises.
    Another handle is used as it is."""
    from radiance_ar.transport import call_streams, copy_transport

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
    monkeypatch.setattr(call_streams, "current_stream_handle", lambda device: handle[0])
    monkeypatch.setattr(call_streams, "dedicated_stream", lambda device: own)

    class FakeTransport:
        own_stream = call_streams.OwnStream(torch.device("cuda", 0))
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


def test_a_replay_runs_where_the_transports_calls_run():
    """TransportBackend.replay_call enters CopyTransport.call_stream (a default-stream
    caller's own stream) and gives that stream, never handle 0, to the reuse fence before
    the replay and to the bookkeeping after it; the call's number is taken inside."""
    import types

    from radiance_ar.backends.transport_backend import TransportBackend

    log = []

    @contextlib.contextmanager
    def call_stream():
        log.append("own stream entered")
        yield 0x77
        log.append("caller waits for own stream")

    @contextlib.contextmanager
    def call(sig):
        log.append(f"call {sig}")
        yield

    backend = types.SimpleNamespace(
        transport=types.SimpleNamespace(
            call_stream=call_stream,
            before_replay=lambda stream: log.append(f"fence on {stream:#x}"),
            after_replay=lambda rnd, stream: log.append(f"{rnd} ends on {stream:#x}")),
        signals=types.SimpleNamespace(call=call))
    with TransportBackend.replay_call(backend, "sig", "round"):
        log.append("replay")
    assert log == ["own stream entered", "call sig", "fence on 0x77", "replay",
                   "round ends on 0x77", "caller waits for own stream"]



def test_a_growth_that_fails_at_its_second_buffer_leaves_none():
    """TransportBuffers.allocate: red's allocation fails after pub's succeeded (a full
    /dev/shm, a killed peer): pub goes too, and the capacity is 0 (the docstring's promise;
    in gpu-host a pub kept would stay mapped and registered)."""
    from radiance_ar.transport.peer_memory import PeerBuffer
    from radiance_ar.transport.transport_buffers import TransportBuffers

    class HalfMemory:
        kind = "cpu-shm"

        def allocate(self, name, nbytes):
            if name == "sdma.red":
                raise OSError("no space for sdma.red")
            return PeerBuffer(name, nbytes, 0, [torch.zeros(nbytes, dtype=torch.uint8)] * 2)

    buffers = TransportBuffers(World(0, 2, torch.device("cpu"), HalfMemory()), None, [1],
                               reduced=True, stage_reduced=False)
    with pytest.raises(OSError, match="no space for sdma.red"):
        buffers.allocate(4096)
    assert (buffers.pub, buffers.red, buffers.capacity) == (None, None, 0)
