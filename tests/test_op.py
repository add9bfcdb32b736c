"""radiance::linear_ar in a one-rank world: opcheck, torch.compile, bad input, scratch."""

import contextlib

import pytest
import torch

from markers import FP8_ON_CPU

from radiance_ar import overlap
import world_jobs
from radiance_ar.transport.world import single_world
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
from radiance_ar.overlap.runtime import MAX_LAYER

OP = torch.ops.radiance.linear_ar.default


@pytest.fixture
def stock_runtime():
    return overlap.configure(single_world("cpu"), OverlapSettings(True, "stock", 8, 4))


def make(rows=16, k=32, cols=24, dtype=torch.bfloat16, seed=0):
    return world_jobs.shard(seed, 0, rows, cols, k, dtype)


@pytest.mark.parametrize("backend", ["stock", "sdma"])  # stock never slices; sdma does
def test_opcheck_decode_and_prefill_rows(backend, monkeypatch):
    rt = overlap.configure(single_world("cpu"), OverlapSettings(True, backend, 8, 4))
    calls = []
    all_reduce = rt.backend.all_reduce
    monkeypatch.setattr(rt.backend, "all_reduce",
                        lambda slice_in, out: (calls.append(slice_in.shape[0]),
                                               all_reduce(slice_in, out))[1])
    for rows in (3, 16):  # below min_m 8: the stock path; at 16: the sliced pipeline
        x, w = make(rows)
        torch.library.opcheck(OP, (x, w, None, "bf16"))
    # sdma: the sliced path was opchecked, 16 rows as 4 slices of 4 (its 3-row calls go
    # to the runtime's stock backend); stock: whole calls only
    assert set(calls) == ({4} if backend == "sdma" else {3, 16})


def test_compiles_as_one_node_and_matches_eager(stock_runtime):
    class RowParallel(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(w, requires_grad=False)

        def forward(self, x):
            return torch.ops.radiance.linear_ar(x * 2, self.w, None, "bf16") + 1

    x, w = make(16)
    mod = RowParallel(w)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(mod, fullgraph=True, backend=record)(x)
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"
             and "linear_ar" in str(n.target)]
    assert len(graphs) == 1 and len(calls) == 1
    torch._dynamo.reset()
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    for rows in (16, 5, 40):  # a shape change must not break the graph either
        xr, _ = make(rows)
        assert torch.equal(compiled(xr), mod(xr))


def test_result_is_the_product_in_a_one_rank_world(stock_runtime):
    x, w = make(16)
    out = torch.ops.radiance.linear_ar(x, w, None, "bf16")
    ref = x.double() @ w.double().t()
    assert (out.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


@pytest.mark.parametrize("mutate,error,match", [
    (lambda x, w: (x.float().to(torch.int32), w), TypeError, "x dtype"),
    (lambda x, w: (x[0], w), ValueError, "x must be 2-D"),
    (lambda x, w: (x.unsqueeze(0), w), ValueError, "x must be 2-D"),
    (lambda x, w: (x, w[0]), ValueError, "weight must be 2-D"),
    (lambda x, w: (x[:, :-1].contiguous(), w), ValueError, "K mismatch"),
    (lambda x, w: (x[:0], w), ValueError, "0 rows"),
    (lambda x, w: (x.t().contiguous().t(), w), ValueError, "contiguous"),
    (lambda x, w: (x, w.to(torch.float16)), TypeError, "weight dtype"),
    (lambda x, w: (x, w.to("meta")), ValueError, "x is on cpu but weight is on meta"),
])
def test_bad_input_raises_clearly(stock_runtime, mutate, error, match):
    x, w = make(16)
    bx, bw = mutate(x, w)
    with pytest.raises(error, match=match):
        torch.ops.radiance.linear_ar(bx, bw, None, "bf16")


def test_unknown_producer_lists_the_registered_ones(stock_runtime):
    x, w = make(16)
    with pytest.raises(ValueError, match="unknown producer 'mxfp4'.*bf16"):
        torch.ops.radiance.linear_ar(x, w, None, "mxfp4")




@FP8_ON_CPU
def test_fp8_rowwise_producer_matches_quantized_reference(stock_runtime):
    x, w = make(16, cols=32)
    w_scale = (w.float().abs().amax(dim=1) / 448.0).clamp_min(1e-12)
    w8 = (w.float() / w_scale[:, None]).to(torch.float8_e4m3fn)
    out = torch.ops.radiance.linear_ar(x, w8, w_scale, "fp8_rowwise")
    x_scale = (x.float().abs().amax(dim=1, keepdim=True) / 448.0)
    x8 = (x.float() / x_scale).to(torch.float8_e4m3fn)
    ref = (x8.double() * x_scale.double()) @ (w8.double() * w_scale.double()[:, None]).t()
    assert (out.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        torch.ops.radiance.linear_ar(x, w8, None, "fp8_rowwise")


def test_no_runtime_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(overlap.runtime, "PROCESS", overlap.runtime.ProcessRuntime())
    x, w = make(4)
    with pytest.raises(RuntimeError, match="overlap.configure"):
        torch.ops.radiance.linear_ar(x, w, None, "bf16")


@FP8_ON_CPU
def test_scratch_is_flat_over_300_calls_of_random_m():
    # The invariant is grow-only after a warm-up at the high-water mark: 300 random M
    # prove it as well as 5000 did (the 5000-call run is the GPU memory test's).
    world = single_world("cpu")
    backend = world_jobs.PeerSumBackend(world)
    rt = overlap.OverlapRuntime(world, OverlapSettings(True, backend.name, 2048, 4), backend)
    x, w = make(16384, k=16, cols=16)
    w_scale = (w.float().abs().amax(dim=1) / 448.0)
    w8 = (w.float() / w_scale[:, None]).to(torch.float8_e4m3fn)
    forward(rt, x, w8, w_scale, "fp8_rowwise")  # warm-up at the high-water mark
    growths, reserved = rt.scratch.growths, rt.scratch.reserved_bytes()
    peer = (world.memory.allocations, world.memory.allocated_bytes)
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        rows = int(torch.randint(1, 16385, (1,), generator=gen))
        out = forward(rt, x[:rows], w8, w_scale, "fp8_rowwise")
        assert out.shape == (rows, w.shape[0])
    assert (rt.scratch.growths, rt.scratch.reserved_bytes()) == (growths, reserved)
    assert (world.memory.allocations, world.memory.allocated_bytes) == peer


def test_the_process_runtime_lifetime():
    proc = overlap.runtime.ProcessRuntime()
    world, settings = single_world("cpu"), OverlapSettings(True, "stock", 8, 4)
    first = proc.configure(world, settings, key="group-a")
    assert proc.current() is first
    assert proc.configure(world, settings, key="group-a") is first  # same key and settings
    second = proc.configure(world, settings, key="group-b")  # another group: a new runtime
    assert second is not first and proc.current() is second
    proc.shutdown()
    with pytest.raises(RuntimeError, match="overlap.configure"):
        proc.current()


@pytest.mark.parametrize("setting,preferred,plan,sizes", [
    ("auto", 3, "uniform", [13, 13, 14]), ("auto", 1, "uniform", [40]),
    (5, 3, "uniform", [8] * 5), (3, 4, "growing", [5, 12, 23]), ("auto", 2, "growing", [13, 27])])
def test_the_slices_are_the_knobs_or_for_auto_the_backends_choice(setting, preferred, plan,
                                                                   sizes):
    """RADIANCE_AR_OVERLAP_SLICES=auto runs the backend's ``preferred_slices_for``; an integer
    wins over it; the plan cuts the rows. Seen at the backend: one all_reduce per slice."""
    world = single_world("cpu")

    class Counting(world_jobs.PeerSumBackend):
        preferred_slices = preferred

        def all_reduce(self, slice_in, out):
            calls.append(slice_in.shape[0])
            super().all_reduce(slice_in, out)

    calls: list[int] = []
    backend = Counting(world)
    rt = overlap.OverlapRuntime(
        world, OverlapSettings(True, backend.name, 8, setting, plan=plan), backend)
    x, w = make(rows=40)
    out = forward(rt, x, w, None, "bf16")
    assert calls == sizes
    torch.testing.assert_close(out.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)


def test_reduce_slices_calls_each_slice_in_one_overlapped_block_between_its_hooks():
    """radiance_ar.overlap.pipeline.reduce_slices, which the op, the sliced-AR timing and the timeline
    share: one all_reduce per slice on its rows, all inside overlapped_calls(), each
    between before(s) and after(s)."""
    from radiance_ar.overlap.pipeline import reduce_slices

    log = []

    class Recording:
        @contextlib.contextmanager
        def overlapped_calls(self):
            log.append("enter")
            yield
            log.append("exit")

        def all_reduce(self, slice_in, out):
            log.append(("ar", slice_in.data_ptr(), out.shape[0]))
            out.copy_(slice_in * 2)

    y, out = torch.arange(10.0).reshape(5, 2), torch.full((5, 2), float("nan"))
    reduce_slices(Recording(), y, out, [0, 1, 3, 5], before=lambda s: log.append(("b", s)),
                  after=lambda s: log.append(("a", s)))
    row = y.stride(0) * y.element_size()
    assert log == ["enter", ("b", 0), ("ar", y.data_ptr(), 1), ("a", 0),
                   ("b", 1), ("ar", y.data_ptr() + row, 2), ("a", 1),
                   ("b", 2), ("ar", y.data_ptr() + 3 * row, 2), ("a", 2), "exit"]
    assert torch.equal(out, y * 2)


class RowCopyProducer:
    """A producer whose GEMM slice copies the prepared rows, logging ``("gemm", a)``."""

    def __init__(self, log: list):
        self.log = log

    def launch(self, prepared, a, b, y, stream):
        self.log.append(("gemm", a))
        y.copy_(prepared[a:b])


class PipelineBackend:
    """What ``run_sliced`` calls of a backend: ``encode_ahead`` does nothing, ``all_reduce``
    doubles its slice; tests override a step to log or fail it."""

    @contextlib.contextmanager
    def overlapped_calls(self):
        yield

    def encode_ahead(self, y, row0):
        return None

    def all_reduce(self, y, out):
        out.copy_(y * 2)


def test_each_slice_is_encoded_ahead_after_its_gemm_and_reduced_with_what_that_returned():
    """radiance_ar.overlap.pipeline.run_sliced: a backend's ``encode_ahead`` runs on the
    GEMM's lane right after each GEMM slice, before the slice is marked done; each
    slice's AR then gets what it returned (``all_reduce_ahead``), or ``all_reduce``
    where it returned None."""
    from radiance_ar.overlap.lanes import Lanes
    from radiance_ar.overlap.pipeline import run_sliced

    log = []

    class Lanes_(Lanes):
        def mark_side(self, slot):
            log.append(("mark", slot))

    class Backend(PipelineBackend):
        def encode_ahead(self, y, row0):
            log.append(("ahead", row0))
            return None if row0 == 1 else ("token", row0, y.data_ptr())

        def all_reduce(self, y, out):
            log.append(("ar", y.data_ptr()))
            super().all_reduce(y, out)

        def all_reduce_ahead(self, y, out, ahead):
            log.append(("ar ahead", ahead))
            out.copy_(y * 3)

    x, y = torch.arange(10.0).reshape(5, 2), torch.empty(5, 2)
    out = torch.full((5, 2), float("nan"))
    run_sliced(x, RowCopyProducer(log), Backend(), y, out, [0, 1, 3, 5],
               Lanes_(torch.device("cpu")))
    row = y.stride(0) * y.element_size()
    assert log == [("gemm", 0), ("ahead", 0), ("mark", 0), ("gemm", 1), ("ahead", 1),
                   ("mark", 1), ("gemm", 3), ("ahead", 3), ("mark", 2),
                   ("ar ahead", ("token", 0, y.data_ptr())), ("ar", y.data_ptr() + row),
                   ("ar ahead", ("token", 3, y.data_ptr() + 3 * row))]
    assert torch.equal(out, torch.cat([x[:1] * 3, x[1:3] * 2, x[3:] * 3]))


@pytest.mark.parametrize("fails_in", ["encode_ahead", "all_reduce"])
def test_a_call_failing_half_way_orders_the_caller_after_the_side_streams_work(fails_in):
    """A slice's side-stream work (its GEMM, its encode ahead) is waited for only by that
    slice's AR; where the call fails before, the caller waits for the whole side stream,
    so its next work cannot overtake a later slice's encode into the same stage rows."""
    from radiance_ar.overlap.lanes import Lanes
    from radiance_ar.overlap.pipeline import run_sliced

    log = []

    class Lanes_(Lanes):
        def caller_waits_for_side(self):
            log.append("caller waits for side")

    class Backend(PipelineBackend):
        def encode_ahead(self, y, row0):
            if fails_in == "encode_ahead" and row0 > 0:
                raise ValueError(fails_in)
            return None

        def all_reduce(self, y, out):
            if fails_in == "all_reduce":
                raise ValueError(fails_in)
            super().all_reduce(y, out)

    x = torch.arange(10.0).reshape(5, 2)
    with pytest.raises(ValueError, match=fails_in):
        run_sliced(x, RowCopyProducer([]), Backend(), torch.empty(5, 2), torch.empty(5, 2),
                   [0, 1, 3, 5], Lanes_(torch.device("cpu")))
    assert log == ["caller waits for side"]


def test_a_sliced_call_is_planned_once_and_a_new_layer_replans_it():
    rt = overlap.build(single_world("cpu"), OverlapSettings(True, "sdma", 8, 4))
    keys = []
    set_call_key = rt.backend.set_call_key
    rt.backend.set_call_key = lambda *key: (keys.append(key), set_call_key(*key))[1]
    x, w = make(16)
    want = torch.mm(x.double(), w.double().t())
    for _ in range(3):
        assert torch.allclose(forward(rt, x, w, None, "bf16").double(), want, rtol=1e-2, atol=1e-2)
    (known,) = rt.sliced_calls.values()
    assert known.plan.bounds == (0, 4, 8, 12, 16) and known.sig.layer == 0
    # every call tells the backend its key (the body sets it before running the slices)
    assert keys and set(keys) == {(16, 32, 0)}
    forward(rt, x[:8].contiguous(), w, None, "bf16")  # other operands: planned apart
    assert len(rt.sliced_calls) == 2
    # A layer registered after a first call (by any runtime sharing the registry, as
    # auto's child runtimes do): its next call is planned anew and carries the number.
    child = overlap.OverlapRuntime(rt.world, rt.settings, rt.backend, _layers=rt._layers)
    forward(child, x, w, None, "bf16")
    assert [c.sig.layer for c in child.sliced_calls.values()] == [0]
    assert rt.register_layer(w) == 1
    for runtime in (rt, child):
        forward(runtime, x, w, None, "bf16")
        assert sorted(c.sig.layer for c in runtime.sliced_calls.values())[-1] == 1
        assert keys[-1] == (16, 32, 1)
    rt.close()


def test_layer_numbers_past_what_a_signature_carries_are_refused():
    rt = overlap.build(single_world("cpu"), OverlapSettings(True, "sdma", 1, 2))
    rt._layers.update((-1 - i, i + 1) for i in range(MAX_LAYER))  # 65535 layers registered
    first = torch.ones(2, 2)
    with pytest.raises(ValueError, match="layer 65536: .* up to 65535"):
        rt.register_layer(first)
    assert rt.layer_number(first) == 0  # not registered
    rt.close()


def test_a_call_from_another_stream_first_waits_for_the_last_calls_stream(monkeypatch):
    """OverlapRuntime._after_last_stream with stand-in streams (no GPU here): the first
    call and calls on the same stream wait for nothing; a call on another stream makes it
    wait for the last call's; a call inside a caller's capture neither waits nor moves the
    last stream."""
    import types

    from radiance_ar.overlap import runtime

    log, current, capturing = [], [0x10], [False]

    class Stream:
        def __init__(self, handle):
            self.handle = handle

        def wait_stream(self, other):
            log.append((self.handle, other.handle))

    monkeypatch.setattr(runtime, "current_stream_handle", lambda device: current[0])
    monkeypatch.setattr(runtime, "stream_object", lambda handle, device: Stream(handle))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    rt = types.SimpleNamespace(world=types.SimpleNamespace(device=torch.device("cuda", 0)),
                               _last_stream=None)

    def call(handle, in_capture=False):
        current[0], capturing[0] = handle, in_capture
        runtime.OverlapRuntime._after_last_stream(rt)

    call(0x10)
    call(0x10)
    assert log == []
    call(0x20)
    assert log == [(0x20, 0x10)]
    call(0x30, in_capture=True)
    assert log == [(0x20, 0x10)] and rt._last_stream == 0x20
    call(0x10)
    assert log == [(0x20, 0x10), (0x10, 0x20)]
