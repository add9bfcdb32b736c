"""The call contract at the flag level: exact tags, mismatches, abort words, the fault
state and resync, on two CpuSignals sharing their words in one process (the real-process
scenarios are in tests/test_misuse.py)."""

import time

import pytest
import torch

from radiance_ar.call_contract import (CallSignature, CollectiveMismatchError, PeerAbortedError,
    PeerTimeoutError, ResyncRequiredError, device_tag, host_tag)
from radiance_ar.transport.peer_memory import PeerBuffer
from radiance_ar.transport.signals import FLAG_BYTES, PASSIVE_EPOCH, CpuSignals
from signal_fakes import RecordedOps

BF16 = torch.bfloat16


def pair(timeout_ms=150.0):
    peers = [torch.zeros(FLAG_BYTES, dtype=torch.uint8) for _ in range(2)]
    return [CpuSignals(PeerBuffer("flags", FLAG_BYTES, r, peers), r, 2, timeout_ms, "test", list)
            for r in range(2)]


def sig(rows=4, cols=256, dtype=BF16, path="flags", m=0, k=0):
    return CallSignature(rows, cols, dtype, path, m, k)


def resync_then_a_good_call(s0, s1, at):
    """Resync both ("collective": both sides in one thread, with a no-op barrier): both
    land on call ``at``, and the next call pairs up on both sides."""
    barrier = lambda: None  # noqa: E731
    assert s0.resync(barrier) == s1.resync(barrier) == at
    with s0.call(sig()) as t0, s1.call(sig()) as t1:
        assert t0 == t1 == at + 1
        s0.post("ready", t0)
        s1.post("ready", t1)
        s0.wait(1, "ready", t0)
        s1.wait(0, "ready", t1)


def test_signature_round_trips_through_header_words_and_tags_differ():
    s = sig(12, 5120, torch.float16, "vendor", 8192, 4352)
    assert CallSignature.from_words(s.words()) == s
    assert host_tag(3, s) >> 32 == 3
    tags = {host_tag(3, sig(rows)) for rows in (4, 5, 6)} | {host_tag(4, sig())}
    assert len(tags) == 4 and 0 not in tags
    assert device_tag(3, sig()) != device_tag(4, sig()) and device_tag(3, sig()) != 0


def test_a_posted_call_with_the_same_signature_passes_and_done_is_monotonic():
    s0, s1 = pair()
    with s0.call(sig()) as t0, s1.call(sig()) as t1:
        assert t0 == t1 == 1
        s1.post("ready", t1)
        s0.wait(1, "ready", t0)
        s1.post("done", t1)
        s0.wait(1, "done", 1)
    with s0.call(sig()) as t:  # call 2: the peer's done of call 1 is no longer enough
        with pytest.raises(PeerTimeoutError, match="'done' for call \\(epoch\\) 2"):
            s0.wait(1, "done", t)


def test_another_shape_is_a_mismatch_naming_both_views_on_both_ranks():
    s0, s1 = pair()
    with s1.call(sig(rows=16, m=64, k=32)) as t:
        s1.post("ready", t)
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as e:
        with s0.call(sig(rows=12, m=48, k=32)) as t:
            s0.post("ready", t)
            s0.wait(1, "ready", t)
    assert time.monotonic() - start < 0.1  # at once, not at the bound
    msg = str(e.value)
    assert "12x256 bfloat16" in msg and "M=48" in msg and "16x256 bfloat16" in msg and "M=64" in msg
    # the waiter gave up: its abort word tells the peer, whose wait then raises too
    s1.epoch -= 1  # replay rank 1's wait of the same call
    with pytest.raises(PeerAbortedError, match="peer rank 0 gave up on call \\(epoch\\) 1"):
        with s1.call(sig(rows=16, m=64, k=32)) as t:
            s1.wait(0, "ready", t)


def test_a_rank_far_behind_sees_a_newer_call_in_its_slot_and_raises():
    s0, s1 = pair()
    s1.epoch = 128  # rank 1's call 129 lands in ring slot 1, where rank 0 awaits call 1
    with s1.call(sig()) as t:
        s1.post("ready", t)
    with pytest.raises(CollectiveMismatchError, match="rank 1 is in call 129"):
        with s0.call(sig()) as t:
            s0.wait(1, "ready", t)


def test_after_an_error_every_call_is_refused_until_resync():
    s0, s1 = pair(timeout_ms=50.0)
    with pytest.raises(PeerTimeoutError):
        with s0.call(sig()) as t:
            s0.post("ready", t)
            s0.wait(1, "ready", t)
    with pytest.raises(ResyncRequiredError, match="PeerTimeoutError.*resync"):
        with s0.call(sig()):
            pass
    with pytest.raises(ResyncRequiredError):
        s0.announce_vendor_call(sig(path="vendor"))
    resync_then_a_good_call(s0, s1, at=1)


def test_a_peer_in_a_vendor_call_this_rank_never_made_is_a_mismatch_at_once():
    s0, s1 = pair(timeout_ms=5000.0)
    s1.announce_vendor_call(sig(rows=40, path="vendor"))
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError, match="vendor all-reduce"):
        with s0.call(sig(rows=16, m=64)) as t:
            s0.wait(1, "ready", t)
    assert time.monotonic() - start < 1.0
    missed = s0.missed_vendor_call()
    assert missed is not None and (missed.rows, missed.path) == (40, "vendor")
    with pytest.raises(PeerAbortedError):  # rank 1, back from its vendor call
        s1.check_vendor_call()


def test_passive_peers_pass_every_wait():
    s0, _ = pair()
    s0.set_passive(1)
    with s0.call(sig()) as t:
        s0.wait(1, "ready", t)
        s0.wait(1, "reduced", t)
        s0.wait(1, "done", t)
    assert s0.peer_value(1, "done") == PASSIVE_EPOCH
    with pytest.raises(ValueError, match="slot 'go'"):
        with s0.call(sig()) as t:
            s0.post("go", t)
    # a resync with a passive peer lands on the calls made, not on the passive marker,
    # and the next call takes the number after it
    assert s0.resync(lambda: None) == 2
    with s0.call(sig()) as t:
        assert t == 3
        s0.wait(1, "ready", t)


def test_a_call_refused_for_an_aborted_peer_takes_no_number_so_resync_agrees():
    s0, s1 = pair(timeout_ms=50.0)
    with pytest.raises(PeerTimeoutError):
        with s0.call(sig()) as t:
            s0.wait(1, "ready", t)
    # s1 finds s0's abort word at its next call's start and refuses before taking a number
    # (a number no header shows would leave s1 one call ahead of s0 after resync).
    with pytest.raises(PeerAbortedError):
        with s1.call(sig()):
            pass
    assert s1.epoch == 0
    resync_then_a_good_call(s0, s1, at=1)


def test_the_gpu_diagnosis_tells_a_peer_stuck_inside_the_call_from_one_in_another():
    """GpuSignals' diagnosis after its bound, on host-visible words (as in the emulated
    world), driven here on CPU tensors: a peer whose header shows the very call awaited
    but which never posted the flag (stuck or gone between two-shot's phases) is a
    timeout naming it; a peer in that epoch with another signature is a mismatch."""
    from collections import deque

    from radiance_ar.transport.gpu_signals import GpuSignals
    from radiance_ar.transport.signals import Signals

    peers = [torch.zeros(FLAG_BYTES, dtype=torch.uint8) for _ in range(2)]
    gpu = GpuSignals.__new__(GpuSignals)  # its stream operations are not used here
    gpu.engine = RecordedOps()
    Signals.__init__(gpu, PeerBuffer("flags", FLAG_BYTES, 0, peers), 0, 2, 150.0, "test", list)
    gpu._awaited = deque()
    peer = CpuSignals(PeerBuffer("flags", FLAG_BYTES, 1, peers), 1, 2, 150.0, "test", list)
    for peer_sig, error, words in ((sig(), PeerTimeoutError, "did not post flag 'reduced'"),
                                   (sig(rows=16), CollectiveMismatchError, "another call")):
        with gpu.call(sig()) as t, peer.call(peer_sig) as tp:
            peer.post("ready", tp)
            gpu._awaited.append((1, "reduced", t, gpu.tag(t), "a two-shot call"))
            found = gpu._diagnose(200.0)
        assert isinstance(found, error) and words in str(found), found
        gpu._awaited.clear()


def _host_gpu_signals(dead=list):
    """GpuSignals of rank 0 on host-visible words (as in the gpu-host and emulated worlds)
    beside a CpuSignals rank 1 writing its own header; their stream operations unused."""
    from collections import deque

    from radiance_ar.transport.gpu_signals import GpuSignals
    from radiance_ar.transport.signals import Signals

    peers = [torch.zeros(FLAG_BYTES, dtype=torch.uint8) for _ in range(2)]
    gpu = GpuSignals.__new__(GpuSignals)
    gpu.engine = RecordedOps()
    Signals.__init__(gpu, PeerBuffer("flags", FLAG_BYTES, 0, peers), 0, 2, 100.0, "test", dead)
    gpu._awaited, gpu._checked_epoch, gpu._replay_rounds = deque(), 0, deque()
    peer = CpuSignals(PeerBuffer("flags", FLAG_BYTES, 1, peers), 1, 2, 100.0, "test", list)
    return gpu, peer


class _EventAt:
    """A stand-in CUDA event that completes at a given monotonic time."""

    def __init__(self, at):
        self.at = at

    def query(self):
        return time.monotonic() >= self.at


def test_a_replay_waits_past_its_bound_for_a_peer_still_capturing_that_call():
    from radiance_ar.transport.signals import _HEADER

    gpu, peer = _host_gpu_signals()
    with gpu.call(sig()) as t:
        pass
    gpu._replayed = ["a token wait"]  # what a replay leaves for check (GpuSignals.replayed)
    word = peer._np[1]
    word[_HEADER["capturing"]] = t  # the peer is capturing the graph of call t
    assert gpu._peer_capturing()
    gpu._last_event = _EventAt(time.monotonic() + 0.4)  # done 4 bounds later
    start = time.monotonic()
    gpu.check()  # no error: it waited while the peer captured
    assert 0.35 < time.monotonic() - start < 5.0
    for value, abort, why in ((t + 1, 0, "another call's graph"), (0, 0, "not capturing"),
                              (t, t, "it gave up")):
        word[_HEADER["capturing"]], word[_HEADER["abort"]] = value, abort
        gpu._replayed = ["a token wait"]
        assert not gpu._peer_capturing(), why
    word[_HEADER["capturing"]], word[_HEADER["abort"]] = t, 0
    dead, _ = _host_gpu_signals(dead=lambda: [1])
    dead._np[1][_HEADER["capturing"]] = dead.epoch = t
    dead._replayed = ["a token wait"]
    assert not dead._peer_capturing()  # a dead peer captures nothing
    gpu._replayed = []
    assert not gpu._peer_capturing()  # an eager call: peers capture no eager call


def test_the_next_call_clears_a_capture_mark():
    from radiance_ar.transport.signals import _HEADER

    gpu, peer = _host_gpu_signals()
    peer._np[1][_HEADER["capturing"]] = 1
    with peer.call(sig()):
        assert peer._np[1][_HEADER["capturing"]] == 0


def test_a_call_completed_by_a_release_raises_though_the_peer_gave_up_on_a_later_call():
    """W = 3, rank 2 missing, host-visible flags (gpu-host, emulated). Rank 0 enqueued calls
    1 and 2 when its check() gave up: its release wrote rank 2's ready of call 1, which
    rank 1's call 1 awaited too, and its abort word holds ITS newest call, 2. Rank 1, which
    enqueued only call 1, sees its call complete; its check() must still raise, since the
    bytes it read from rank 2 were never published (GpuSignals._raise_if_released_by_a_peer)."""
    from radiance_ar.transport.gpu_signals import GpuSignals
    from radiance_ar.transport.signals import _HEADER, _word

    size = 3
    words = [torch.zeros(FLAG_BYTES, dtype=torch.uint8) for _ in range(size)]
    ranks = [GpuSignals(PeerBuffer("flags", FLAG_BYTES, r, words), r, size, 100.0,
                        RecordedOps(), "sdma", lambda: []) for r in (0, 1)]

    class EndEvent:  # complete once every wait enqueued before it is satisfied
        def __init__(self, signals):
            self.signals, self.waits = signals, []

        def record(self, stream):
            self.waits = list(self.signals._awaited)

        def query(self):
            return all(self.signals._satisfied(*w[:4]) for w in self.waits)

    for s in ranks:
        s.EVENT_TYPE = lambda s=s: EndEvent(s)

    def enqueue_call(s):
        with s.call(sig()) as t:
            s._np[s.rank][_word("ready", t)] = s.tag(t)  # its stream's post, as executed
            s.wait_all([p for p in range(size) if p != s.rank], "ready", t, 0, "sdma one-shot")
            s.end_call(0)

    enqueue_call(ranks[0])
    enqueue_call(ranks[0])
    enqueue_call(ranks[1])
    with pytest.raises(PeerTimeoutError):
        ranks[0].check()
    assert ranks[0]._read(0, _HEADER["abort"]) == 2
    with pytest.raises(PeerAbortedError, match="its release of its own stream"):
        ranks[1].check()
