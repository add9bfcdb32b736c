"""radiance_ar.transport.call_streams with stand-in streams and events (no GPU here): which stream a
call runs on, what it waits for, and what the caller waits for, in and out of a block.

Each event logs the record it holds (``end0#2``: event end0 as recorded the 2nd time), so
a wait names exactly which call it orders after."""

from __future__ import annotations

import pytest
import torch

from radiance_ar.transport import call_streams
from radiance_ar.transport.call_streams import CallStreams, Footprint


class FakeEvent:
    made = 0

    def __init__(self, log):
        self.log, self.records, self.stream = log, 0, None
        self.name = None

    def record(self, stream):
        self.records += 1
        self.stream = stream
        self.log.append(f"{stream.name} records {self.label()}")

    def label(self):
        return f"{self.name}#{self.records}"


class FakeStream:
    def __init__(self, name, handle, log):
        self.name, self.cuda_stream, self.log = name, handle, log

    def wait_event(self, event):
        self.log.append(f"{self.name} waits {event.label()}")


@pytest.fixture
def world(monkeypatch):
    log = []
    streams = {0x10: FakeStream("caller", 0x10, log)}
    made = iter([FakeStream("P0", 0x20, log), FakeStream("P1", 0x30, log)])

    def dedicated(device):
        s = next(made)
        streams[s.cuda_stream] = s
        return s

    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(call_streams, "dedicated_stream", dedicated)
    monkeypatch.setattr(call_streams, "current_stream_handle", lambda device: 0x10)
    cs = CallStreams(torch.device("cuda", 0), 2, streams.__getitem__)
    for k in range(2):
        cs._in[k].name, cs._end[k].name = f"in{k}", f"end{k}"
    return cs, log


def fp(lo, hi, base=1 << 20):
    """A call on bytes [lo, hi) of the buffers, reading and writing base + [lo, hi)."""
    return Footprint(lo, hi, base + lo, base + hi, 2 * base + lo, 2 * base + hi)


def one_call(cs, log, footprint):
    with cs.call(0x10, footprint) as stream:
        log.append(f"steps on {stream:#x}")
        cs.before_done(stream)
        log.append("done posted")


def test_outside_a_block_every_call_is_ordered_on_return(world):
    cs, log = world
    one_call(cs, log, fp(0, 100))
    one_call(cs, log, fp(100, 200))
    assert log == [
        "caller records in0#1", "P0 waits in0#1", "steps on 0x20", "done posted",
        "P0 records end0#1", "caller waits end0#1",
        "caller records in1#1", "P1 waits in1#1", "steps on 0x30",
        "P1 waits end0#1", "done posted",  # done posts stay in call order
        "P1 records end1#1", "caller waits end1#1"]


def test_in_a_block_disjoint_calls_overlap_and_the_block_end_joins_them(world):
    cs, log = world
    with cs.overlapped():
        for k in range(3):
            one_call(cs, log, fp(100 * k, 100 * (k + 1)))
        assert not any(x.startswith("caller waits") for x in log)
    assert log == [
        "caller records in0#1", "P0 waits in0#1", "steps on 0x20", "done posted",
        "P0 records end0#1",
        "caller records in1#1", "P1 waits in1#1", "steps on 0x30",
        "P1 waits end0#1", "done posted", "P1 records end1#1",
        "caller records in0#2", "P0 waits in0#2", "steps on 0x20",
        "P0 waits end1#1", "done posted", "P0 records end0#2",
        "caller waits end0#2", "caller waits end1#1"]


@pytest.mark.parametrize("second", [
    fp(50, 150),                                       # shares buffer bytes
    Footprint(100, 200, 2 << 20, (2 << 20) + 8, 9 << 20, 10 << 20),  # reads call 0's out
    Footprint(100, 200, 7 << 20, 8 << 20, 1 << 20, (1 << 20) + 8),  # writes call 0's input
    Footprint(100, 200, 7 << 20, 8 << 20, (2 << 20) + 50, 3 << 20),  # writes call 0's out
])
def test_calls_that_share_bytes_run_in_turn(world, second):
    cs, log = world
    with cs.overlapped():
        one_call(cs, log, fp(0, 100))
        log.clear()
        one_call(cs, log, second)
    assert log[:3] == ["caller records in1#1", "P1 waits in1#1", "P1 waits end0#1"]


def test_a_block_that_raises_still_joins(world):
    cs, log = world
    with pytest.raises(RuntimeError, match="boom"):
        with cs.overlapped():
            one_call(cs, log, fp(0, 100))
            raise RuntimeError("boom")
    assert log[-1] == "caller waits end0#1"


def test_one_stream_runs_calls_on_the_caller(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", lambda: pytest.fail("no events with one stream"))
    cs = CallStreams(torch.device("cuda", 0), 1, lambda h: pytest.fail("no stream objects"))
    with cs.overlapped():
        with cs.call(0x10, fp(0, 1)) as stream:
            cs.before_done(stream)
    assert stream == 0x10 and cs.streams == []


def test_a_done_post_off_the_call_streams_waits_for_every_unjoined_call(world):
    """A call not entered through call() (the caller's own stream) posts done only after
    every call of the block still in flight; inside call() the wait is for the previous
    call only, and it is not carried past the call's end."""
    cs, log = world
    caller = 0x10
    with cs.overlapped():
        one_call(cs, log, fp(0, 100))
        one_call(cs, log, fp(100, 200))
        assert cs._done_after is None
        log.clear()
        cs.before_done(caller)
        assert log == ["caller waits end0#1", "caller waits end1#1"]
    assert cs.is_call_stream(0x20) and cs.is_call_stream(0x30) and not cs.is_call_stream(caller)


def test_the_reuse_fence_keeps_its_entries_when_it_ran_on_a_call_stream():
    """CopyTransport.fence with stand-ins: a fence on a call stream waits, but later calls
    may run on the other stream, so the entries stay for their fences until every call
    stream has waited past them; a fence on the caller's stream (which every later call
    follows) retires them at once."""
    from radiance_ar.transport.copy_transport import CopyTransport

    waits = []

    class Signals:
        def wait_all(self, peers, slot, epoch, stream, what):
            waits.extend((peer, slot, epoch, stream) for peer in peers)

    class Streams:
        def is_call_stream(self, stream):
            return stream in (0x20, 0x30)

        def handles(self):
            return [0x20, 0x30]

    class Transport:
        signals, peers, call_streams = Signals(), [1], Streams()
        fence = CopyTransport.fence

    tr = Transport()
    tr._pending, tr._fenced_on = [(1, 0, 100), (2, 100, 200)], {}
    tr.fence(0, 150, 0x20)
    assert waits == [(1, "done", 2, 0x20)] and len(tr._pending) == 2
    tr.fence(0, 150, 0x10)
    assert waits[-1] == (1, "done", 2, 0x10) and tr._pending == []
    # calls on the two call streams only, no fence on the caller's: the entries go once
    # both streams waited past them (the list stayed bounded by nothing before)
    tr._pending = [(3, 0, 100), (4, 100, 200)]
    tr.fence(0, 50, 0x20)  # waits for 3: stream 0x30 has not
    assert waits[-1] == (1, "done", 3, 0x20) and len(tr._pending) == 2
    tr.fence(100, 150, 0x30)  # waits for 4: both past 3
    assert waits[-1] == (1, "done", 4, 0x30) and tr._pending == [(4, 100, 200)]
    tr._pending.append((5, 0, 100))
    tr.fence(0, 200, 0x20)  # waits for 5: both past 4
    assert tr._pending == [(5, 0, 100)]


def test_emulated_ranks_get_two_call_streams_only_within_the_hardware_queues():
    from radiance_ar.backends.transport_backend import emulated_streams_reason
    from radiance_ar.transport.world import World

    class Mem:
        def __init__(self, kind):
            self.kind = kind

    def world(kind, size):
        return World(0, size, torch.device("cuda", 0), Mem(kind))

    assert emulated_streams_reason(world("gpu-emulated", 4), 2) is None
    assert emulated_streams_reason(world("gpu-emulated", 6), 2) is None
    assert "RADIANCE_AR_SDMA_CALL_STREAMS=1" in emulated_streams_reason(world("gpu-emulated", 7), 2)
    assert emulated_streams_reason(world("gpu-emulated", 8), 1) is None
    assert emulated_streams_reason(world("gpu-symm", 8), 2) is None


def test_on_rocm_the_queue_budget_is_gpu_max_hw_queues(monkeypatch):
    """ROCm's runtime keeps 4 hardware queues per device unless GPU_MAX_HW_QUEUES says
    more (rocclr's default): emulated ranks check their streams against that; the tools
    that start emulated ranks ask for 32, as they ask CUDA for 32 connections."""
    from radiance_ar import envs
    from radiance_ar.backends import transport_backend
    from radiance_ar.transport.world import World

    class Mem:
        kind = "gpu-emulated"

    def reason(size, call_streams):
        return transport_backend.emulated_streams_reason(
            World(0, size, torch.device("cuda", 0), Mem()), call_streams)

    monkeypatch.setattr(transport_backend, "platform", lambda device: "hip")
    monkeypatch.delenv("GPU_MAX_HW_QUEUES", raising=False)
    assert "2 emulated ranks x 4 streams exceed the GPU's 4 hardware queues (GPU_MAX_HW_QUEUES); " \
           "raise GPU_MAX_HW_QUEUES" in reason(2, 1)
    monkeypatch.setenv("GPU_MAX_HW_QUEUES", "32")
    assert reason(8, 1) is None and reason(6, 2) is None
    assert "RADIANCE_AR_SDMA_CALL_STREAMS=1" in reason(7, 2)
    monkeypatch.setenv("GPU_MAX_HW_QUEUES", "four")
    with pytest.raises(ValueError, match="GPU_MAX_HW_QUEUES='four': expected an integer >= 1"):
        reason(2, 1)
    environ = {}
    envs.prepare_cuda_for_emulated_ranks(environ)
    assert envs.hip_hardware_queues(environ) == 32


def test_the_ops_side_stream_is_replaced_when_the_pool_hands_out_the_callers(monkeypatch):
    """radiance_ar.overlap.lanes.Lanes with stand-in streams (no GPU here): torch's pool may give the
    side stream the caller's stream; the next call then takes a fresh side stream, ordered
    after the old one, and the GEMMs no longer queue behind the all-reduces."""
    from radiance_ar.overlap.lanes import Lanes

    log = []

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

        def wait_stream(self, other):
            log.append((self.cuda_stream, other.cuda_stream))

    pool = iter([Stream(0x10), Stream(0x20)])  # the first side stream is the caller's
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: next(pool))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(0x10))
    lanes = Lanes(torch.device("cuda", 0))
    assert lanes.side_handle == 0x10
    lanes.side_waits_for_caller()
    assert lanes.side_handle == 0x20 and log == [(0x20, 0x10), (0x20, 0x10)]
