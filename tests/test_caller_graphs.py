"""Op calls inside a caller's CUDA graph (radiance_ar.transport.caller_graphs) on the CPU:
where they are allowed and the reason given where not, the entry barrier a caller's round
opens with, the counts the graph keeps (its kernel under Triton's interpreter), the
watchdog stopping on counts that stop moving, and buffers held against growth. The
wiring of a caller's round runs the real methods on stand-ins for their collaborators."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import world_jobs
from markers import FP8_ON_CPU
from interpreter import run_under_interpreter
from radiance_ar import overlap
from radiance_ar.backends.sdma import SdmaBackend
from radiance_ar.backends.transport_backend import TransportBackend
from radiance_ar import buffers
from radiance_ar.buffers import refuse_growth_in_capture
from radiance_ar.call_contract import CallSignature, ResyncRequiredError
from radiance_ar.overlap import op
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.plan import in_caller_capture
from radiance_ar.overlap.scratch import ScratchPool
from radiance_ar.transport import tokens
from radiance_ar.transport.call_streams import CallStreams
from radiance_ar.transport.caller_graphs import caller_capture_reason
from radiance_ar.transport.copy_transport import CopyTransport
from radiance_ar.transport.signals import _HEADER as HEADER_WORDS
from radiance_ar.transport.watchdog import Watchdog
from radiance_ar.transport.world import single_world
from signal_fakes import gpu_signals

SIG = CallSignature(2048, 5120, torch.bfloat16, "flags", 2048, 4352, 17)
CPU = torch.device("cpu")


def test_the_gate_needs_graphs_not_off_then_replayable_calls_then_the_watchdog():
    for graphs in ("on", "auto"):
        assert caller_capture_reason(graphs, None, None) is None
        assert caller_capture_reason(graphs, "one rank: the op's all-reduce is a copy",
                                     None) == (
            "its calls cannot be captured here: one rank: the op's all-reduce is a copy")
        why = caller_capture_reason(graphs, None, "RADIANCE_AR_WATCHDOG_S=0 (off)")
        assert why.startswith("a caller's replay runs none of this host's code, so only the "
                              "watchdog bounds its waits on peers")
        assert why.endswith("RADIANCE_AR_WATCHDOG_S=0 (off)")
    for replay, watchdog in ((None, None), ("any", None), (None, "any")):
        assert caller_capture_reason("off", replay, watchdog) == (
            "RADIANCE_AR_OP_GRAPHS=off: no op call is captured")


class Runtime(SimpleNamespace):
    """What ``in_caller_capture`` reads of a runtime."""

    def caller_capture_reason(self):
        return self.reason


def capturing_x(rows: int = 4096):
    """Stands for a CUDA tensor on a capturing stream (the capture itself is the GPU test's)."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(rows, 4352))


def test_a_refused_capture_names_the_backend_and_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    rt = Runtime(backend=SimpleNamespace(name="sdma"), settings=SimpleNamespace(min_m=2048),
                 reason="the reason given")
    with pytest.raises(RuntimeError, match=r"backend 'sdma' cannot run its sliced path \(M = "
                       r"4096 >= RADIANCE_AR_OVERLAP_MIN_M = 2048\) inside CUDA-graph capture: "
                       r"the reason given; capture only the decode path"):
        in_caller_capture(rt, capturing_x())
    rt.reason = None
    assert in_caller_capture(rt, capturing_x())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not in_caller_capture(rt, capturing_x())
    assert not in_caller_capture(rt, torch.zeros(4, 4))  # a CPU tensor is never captured


@pytest.mark.parametrize("size", [2, 4])
def test_a_callers_round_opens_with_the_entry_barrier_and_marks_nothing(size):
    rank = 1
    signals, flags, inbox, engine = gpu_signals(size, rank)
    peers = [p for p in range(size) if p != rank]
    ended = []
    with tokens.capture_round(signals, CallStreams(CPU, 1, None), peers, CPU,
                              lambda: ended.append(True), entry=SIG) as rnd:
        # no mark for peers' hosts: none bounds a caller's replay
        assert int(flags.peer(rank).view(torch.int64)[HEADER_WORDS["capturing"]]) == 0
        with signals.call(SIG):
            signals.post("done", signals.epoch, 0)
    (s0, entry), (s1, done_post), (s2, done_wait) = engine.batches
    assert s0 == s1 == s2 == 0  # all on the capturing stream
    value = tokens.token_value("entry", 0, SIG)
    theirs = [inbox.peer(p).data_ptr() + tokens.word("entry", rank, 0, size) * tokens.WORD_BYTES
              for p in peers]
    mine = [inbox.peer(rank).data_ptr() + tokens.word("entry", p, 0, size) * tokens.WORD_BYTES
            for p in peers]
    # the barrier is one batch (one graph node on CUDA): post mine, wait for theirs, reset
    assert entry == ([("write", a, value) for a in theirs] + [("wait_eq", a, value) for a in mine]
                     + [("write", a, 0) for a in mine])
    assert [op for op, _, _ in done_post] == ["write"] * (size - 1)
    assert [op for op, _, _ in done_wait] == ["wait_eq"] * (size - 1) + ["write"] * (size - 1)
    assert [(a.kind, a.peer) for a in rnd.awaited] == (
        [("entry", p) for p in peers] + [("done", p) for p in peers])
    assert rnd.end_event is None and ended == [True] and signals.round is None


def test_the_entry_token_has_words_and_values_of_its_own():
    size = 4
    entry = {tokens.word("entry", p, k, size) for p in range(size) for k in range(tokens.MAX_CALLS)}
    others = {tokens.word(kind, p, k, size) for kind in ("ready", "reduced", "done")
              for p in range(size) for k in range(tokens.MAX_CALLS)}
    assert not entry & others and max(entry) * tokens.WORD_BYTES < tokens.inbox_bytes(size)
    values = {tokens.token_value(kind, 0, SIG) for kind in tokens.KINDS}
    assert len(values) == len(tokens.KINDS) and 0 not in values


def test_the_graphs_counts_under_the_interpreter():
    # The kernel a caller's graph runs at each op call's entry and exit, on CPU tensors
    # (Triton's interpreter): the counts and the ident, the warm-up leaving them at 0.
    run_under_interpreter("""
import torch
from radiance_ar.call_contract import CallSignature
from radiance_ar.transport.caller_graphs import CallerProgress
p = CallerProgress(torch.device("cpu"))
assert p.snapshot() == (0, 0, 0), p.snapshot()
a = CallSignature(2048, 5120, torch.bfloat16, "flags", 2048, 4352, 3)
b = CallSignature(4096, 5120, torch.bfloat16, "flags", 4096, 4352, 4)
p.enter(a)
assert p.snapshot() == (1, 0, 1), p.snapshot()
p.leave()
p.enter(b)
assert p.snapshot() == (2, 1, 2), p.snapshot()
assert p.describe(2) == b.describe() and p.describe(1) == a.describe()
assert p.describe(0) == "call 0"
print("interpreter-ok")
""")


class Counts:
    """A progress block the test writes: what the watchdog reads of a CallerProgress."""

    def __init__(self):
        self.words = np.zeros(3, dtype=np.int64)

    def snapshot(self):
        return tuple(int(w) for w in self.words)

    def describe(self, ident):
        return f"the test's call {ident}"


def watched(limit: float = 5.0):
    signals, flags, _, _ = gpu_signals(2, 0)
    counts, stops, clock = Counts(), [], [0.0]
    dog = Watchdog(signals, limit, stop=stops.append, clock=lambda: clock[0], start=False,
                   progress=counts)

    def poll_at(t: float) -> bool:
        clock[0] = t
        return dog.poll()

    return signals, flags, counts, stops, poll_at


def test_a_call_inside_a_callers_graph_that_stops_counting_stops_the_process():
    signals, flags, counts, stops, poll_at = watched()
    assert not poll_at(0.0)
    counts.words[:] = (1, 1, 1)  # one call entered and left: nothing in flight
    assert not poll_at(100.0)
    counts.words[:] = (2, 1, 2)  # the second entered
    assert [poll_at(t) for t in (101.0, 105.9)] == [False, False]  # the clock starts at 101
    assert poll_at(106.1) and len(stops) == 1
    assert stops[0] == ("the op call of the test's call 2, inside a caller's CUDA graph, made "
                        "no progress for 5 s (2 such calls entered, 1 left): a peer never "
                        "posted its tokens, or posted another call's")
    assert int(flags.peer(0).view(torch.int64)[HEADER_WORDS["abort"]]) >= 1  # peers told
    with pytest.raises(ResyncRequiredError, match="PeerTimeoutError"):
        with signals.call(SIG):
            pass


def test_graphs_that_keep_counting_are_progress():
    # A decode loop replays the graph for ever: entered and left move, whatever the clock.
    _, _, counts, stops, poll_at = watched()
    for step in range(1, 40):
        counts.words[:] = (step, step - 1, 1)  # sampled mid-call, every time
        assert not poll_at(step * 4.0)
    counts.words[:] = (39, 39, 1)
    assert not poll_at(1000.0) and stops == []


def test_held_buffers_refuse_to_grow_or_keep_the_old_one(caplog):
    with pytest.raises(RuntimeError, match="sdma buffers: growth requested after a caller's "
                       "CUDA graph captured op calls that use these buffers"):
        refuse_growth_in_capture("sdma buffers", CPU, held=True)
    refuse_growth_in_capture("sdma buffers", CPU)  # not held, not capturing
    pool = ScratchPool()
    first = pool.get("gemm", (4, 8), torch.bfloat16, CPU)
    old = first.untyped_storage().data_ptr()
    pool.held = True
    assert pool.get("gemm", (2, 8), torch.bfloat16, CPU).data_ptr() == old  # fits: nothing moves
    with caplog.at_level("WARNING", logger="radiance_ar"):
        grown = pool.get("gemm", (64, 8), torch.bfloat16, CPU)  # one rank's own: grows
    assert grown.data_ptr() != old and pool.growths == 2
    kept = [b for b in buffers._kept if isinstance(b, torch.Tensor) and b.data_ptr() == old]
    assert len(kept) == 1, "the buffer a caller's graph captured was let go"
    assert "scratch buffer 'gemm' (64 B) replaced after a caller's CUDA graph" in caplog.text
    buffers._kept.remove(kept[0])


class Recorder:
    """Stands for what a caller's round drives: records the order of its steps."""

    def __init__(self):
        self.steps = []

    def enter(self, sig):
        self.steps.append(("entered", sig.layer))

    def leave(self):
        self.steps.append("left")

    @contextlib.contextmanager
    def capture_round(self, end, entry=None):
        self.steps.append(("round", entry.layer))
        yield "the round"
        self.steps.append("done tokens consumed")


@pytest.mark.parametrize("fails", [False, True])
def test_a_callers_round_is_counted_around_the_tokens_and_kept(fails):
    rec = Recorder()
    backend = SimpleNamespace(caller_progress=rec, transport=rec, caller_rounds=[])
    with contextlib.suppress(RuntimeError):
        with TransportBackend.caller_capture_round(backend, SIG):
            rec.steps.append("the op's sliced path")
            if fails:
                raise RuntimeError("the capture failed")
    if fails:  # nothing counted as left, no round kept: the caller has no graph
        assert rec.steps == [("entered", 17), ("round", 17), "the op's sliced path"]
        assert backend.caller_rounds == []
    else:
        assert rec.steps == [("entered", 17), ("round", 17), "the op's sliced path",
                             "done tokens consumed", "left"]
        assert backend.caller_rounds == ["the round"]


@pytest.mark.parametrize("fails", [False, True])
def test_a_transport_captured_by_a_caller_holds_its_buffers(fails):
    signals, _, _, _ = gpu_signals(2, 0)

    @contextlib.contextmanager
    def graph_forms():
        yield []

    transport = SimpleNamespace(
        signals=signals, buffers=SimpleNamespace(in_graph=graph_forms),
        engine=SimpleNamespace(in_graph=graph_forms), call_streams=CallStreams(CPU, 1, None),
        peers=[1], world=SimpleNamespace(device=CPU), held=False, owner="sdma", capacity=1024,
        decode_lane=None)
    with contextlib.suppress(RuntimeError):
        with CopyTransport.capture_round(transport, lambda: None, entry=SIG):
            if fails:
                raise RuntimeError("the capture failed")
    assert transport.held is not fails
    with CopyTransport.capture_round(transport, lambda: None):  # the op's own: holds nothing
        pass
    assert transport.held is not fails
    if not fails:
        with pytest.raises(RuntimeError, match=r"sdma buffers \(4096 B per slice buffer\): "
                           "growth requested after a caller's CUDA graph"):
            CopyTransport.ensure_capacity(transport, 4096)


def test_closing_what_a_callers_graph_holds_keeps_it_and_says_so(caplog):
    # A real SdmaBackend, not built (no world): what close() reads is its transport's hold.
    closed = []
    backend = SdmaBackend.__new__(SdmaBackend)
    backend.watchdog = None
    backend.transport = SimpleNamespace(held=True, close=lambda: closed.append(True))
    with caplog.at_level("WARNING", logger="radiance_ar"):
        backend.close()
        backend.close()  # kept once, said once
    assert closed == [] and [k for k in buffers._kept if k is backend] == [backend]
    assert caplog.text.count("backend 'sdma' closed after a caller's CUDA graph") == 1
    buffers._kept.remove(backend)
    backend.transport.held = False
    backend.close()
    assert closed == [True]


def test_the_op_runs_a_callers_capture_as_one_round_and_holds_its_scratch(monkeypatch):
    # One CPU rank, a capture-safe backend whose GEMM output is the op's scratch buffer; the
    # capture itself stood for (a CPU tensor is never captured): the op must not reach for
    # its own graph cache, and afterwards neither the scratch nor the backend may grow.
    rt = overlap.build(single_world("cpu"), OverlapSettings(True, "oneshot_wht6", 8, 2))
    monkeypatch.setattr(buffers, "_kept", [])  # what this test keeps, and only that
    monkeypatch.setattr(op, "in_caller_capture", lambda rt_, x_: True)
    monkeypatch.setattr(rt, "graphs", lambda: pytest.fail("the op's own graphs in a capture"))
    x, w = world_jobs.shard(0, 0, 16, 256, 32)
    out = op.forward(rt, x, w, None, "bf16")
    assert torch.equal(out, torch.mm(x, w.t()))
    assert rt.scratch.held and rt.backend.held
    # a larger eager call: the scratch grows into a new buffer, the captured one kept
    growths = rt.scratch.growths
    big, _ = world_jobs.shard(1, 0, 64, 256, 32)
    assert torch.equal(op.forward(rt, big, w, None, "bf16"), torch.mm(big, w.t()))
    assert rt.scratch.growths == growths + 1
    rt.close()  # what the graph holds is kept, not freed
    assert [type(k).__name__ for k in buffers._kept] == ["Tensor", "ScratchPool",
                                                         "OneshotWht6Backend"]


@FP8_ON_CPU
def test_a_decode_call_in_a_callers_capture_holds_the_scratch_it_used(monkeypatch):
    """The decode path (M below min_m) of an fp8 producer quantizes x into a scratch buffer,
    whose address a caller's graph replays: a capture of it holds the pool, so a later
    eager call that grows the buffer keeps the captured one instead of freeing it."""
    rt = overlap.build(single_world("cpu"), OverlapSettings(True, "stock", 64, 2))
    monkeypatch.setattr(buffers, "_kept", [])  # what this test keeps, and only that
    x, w = world_jobs.shard(0, 0, 8, 256, 32)
    w_scale = (w.float().abs().amax(dim=1) / 448.0).clamp_min(1e-12)
    w8 = (w.float() / w_scale[:, None]).to(torch.float8_e4m3fn)
    monkeypatch.setattr(op, "capturing", lambda x_: True)  # the capture itself, stood for
    op.forward(rt, x, w8, w_scale, "fp8_rowwise")
    assert rt.scratch.held
    monkeypatch.setattr(op, "capturing", lambda x_: False)
    big, _ = world_jobs.shard(1, 0, 48, 256, 32)
    growths = rt.scratch.growths
    op.forward(rt, big, w8, w_scale, "fp8_rowwise")
    assert rt.scratch.growths > growths and buffers._kept  # the captured buffer kept
    rt.close()
