"""The watchdog (radiance_ar.transport.watchdog) on the CPU: where it runs, when a stall
stops the process and when progress does not, the error it names, its own thread, and
the real SIGABRT of a process it stops. Its signals are GpuSignals over host flags with
recorded stream operations and events the test completes (tests/signal_fakes.py)."""

import gc
import subprocess
import sys
import threading
import time

import pytest
import torch

from radiance_ar import envs, overlap
from radiance_ar.call_contract import CallSignature, ResyncRequiredError
from radiance_ar.envs import BackendSettings
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.transport.signals import _HEADER as HEADER_WORDS, _word as signals_word
from radiance_ar.transport.watchdog import Watchdog, watchdog_reason
from radiance_ar.transport.world import single_world
from signal_fakes import StreamBlockedUntil, gpu_signals

SIG = CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, 7)


def test_it_runs_where_each_rank_is_a_process_on_a_gpu():
    assert watchdog_reason("gpu-host", 600.0) is None
    assert watchdog_reason("gpu-symm", 10.0) is None
    assert watchdog_reason("gpu-host", 0.0) == "RADIANCE_AR_WATCHDOG_S=0 (off)"
    assert "one host thread drives every rank" in watchdog_reason("gpu-emulated", 600.0)
    assert "RADIANCE_AR_SPIN_TIMEOUT_MS" in watchdog_reason("cpu-shm", 600.0)
    assert watchdog_reason("single", 600.0) == "one rank: no call waits on a peer"
    # a stall shorter than 10 s is a healthy wait: the knob itself refuses such a limit,
    # from the environment or from code, whatever the world or backend
    with pytest.raises(ValueError, match=r"RADIANCE_AR_WATCHDOG_S='0.5': expected a finite "
                                         r"number in \[10, 86400\], or 0 \(off\)"):
        envs.get("RADIANCE_AR_WATCHDOG_S", {"RADIANCE_AR_WATCHDOG_S": "0.5"})
    assert envs.get("RADIANCE_AR_WATCHDOG_S", {"RADIANCE_AR_WATCHDOG_S": "0"}) == 0.0
    with pytest.raises(ValueError, match="limit_s 0: expected seconds > 0"):
        Watchdog(None, 0, start=False)


class Stalled:
    """Rank 0 of 2 with a watchdog of ``limit`` s on a clock the test moves, whose calls
    finish when ``self.done`` says."""

    def __init__(self, limit: float = 5.0, size: int = 2):
        self.signals, self.flags, _, _ = gpu_signals(size, 0)
        self.done = False
        self.signals.EVENT_TYPE = lambda: StreamBlockedUntil(lambda: self.done)
        self.now, self.stops = 0.0, []
        self.dog = Watchdog(self.signals, limit, stop=self.stops.append, clock=lambda: self.now,
                            start=False)

    def call(self, posted: bool = False) -> None:
        """An eager call waiting for peer 1's ready flag, its end enqueued; ``posted``: peer 1
        posts it (a call that completed)."""
        with self.signals.call(SIG) as epoch:
            self.signals.wait_all([1], "ready", epoch, 7, "the test's call")
            self.signals.end_call(7)
            if posted:
                words = self.flags.peer(1).view(torch.int64)
                words[signals_word("ready", epoch)] = self.signals.tag(epoch)

    def poll_at(self, t: float) -> bool:
        self.now = t
        return self.dog.poll()


def test_a_stalled_call_stops_the_process_naming_the_missing_peer():
    s = Stalled()
    assert not s.poll_at(0.0)  # no call yet
    s.call()
    assert [s.poll_at(t) for t in (1.0, 5.9)] == [False, False]  # the clock starts at 1.0
    assert s.poll_at(6.1) and len(s.stops) == 1
    message = s.stops[0]
    assert message.startswith("no progress for 5 s with a call unfinished")
    assert "peer rank 1 did not post flag 'ready' for call (epoch) 1 of the test's call" in message
    assert "released" not in message  # the watchdog stops; it does not release
    assert s.dog.fired == message
    assert int(s.flags.peer(0).view(torch.int64)[HEADER_WORDS["abort"]]) == 1  # peers told
    with pytest.raises(ResyncRequiredError, match="PeerTimeoutError"):
        s.call()  # this rank refuses every call after it


def test_progress_is_a_new_call_or_the_newest_one_finishing():
    s = Stalled()
    s.call()
    assert not s.poll_at(0.0)
    s.call()  # the host enqueued more: it is not stalled, it runs ahead of its GPU
    assert [s.poll_at(t) for t in (4.0, 8.9)] == [False, False]
    s.done = True  # the stream caught up
    assert not s.poll_at(100.0)
    s.done = False
    s.call()
    assert [s.poll_at(t) for t in (200.0, 204.9, 205.1)] == [False, False, True]
    assert not any("released" in m for m in s.stops) and len(s.stops) == 1


def test_its_thread_stops_a_stall_on_its_own():
    signals, _, _, _ = gpu_signals(2, 0)
    signals.EVENT_TYPE = StreamBlockedUntil  # never finishes
    stops = []
    dog = Watchdog(signals, 0.3, stop=stops.append)
    try:
        with signals.call(SIG) as epoch:
            signals.wait_all([1], "ready", epoch, 7, "the test's call")
            signals.end_call(7)
        start = time.monotonic()
        while not stops and time.monotonic() - start < 5.0:
            time.sleep(0.01)
        took = time.monotonic() - start
    finally:
        dog.close()
    assert len(stops) == 1 and "peer rank 1" in stops[0]
    assert 0.3 <= took < 0.3 + 4 * Watchdog.POLL_S + 0.5, took  # the limit, then a few looks


def test_a_stopped_process_removes_its_job_directory_and_dies_by_sigabrt(tmp_path):
    # the directory rank 0 of a gpu-host job made (SharedFileMemory registers its removal)
    job = tmp_path / "radiance-ar-job"
    job.mkdir(mode=0o700)
    # a clean-up that raises, registered first, cancels neither the stop nor the next one
    code = ("import shutil, sys, weakref\n"
            "from radiance_ar.transport.watchdog import run_at_stop, stop_process\n"
            "class Owner: pass\n"
            "owner, other = Owner(), Owner()\n"
            "run_at_stop(weakref.finalize(other, shutil.rmtree, sys.argv[1] + '-gone'))\n"
            "run_at_stop(weakref.finalize(owner, shutil.rmtree, sys.argv[1]))\n"
            "stop_process('rank 0: peer rank 1 did not post flag ready.')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -6, (proc.returncode, proc.stderr)  # SIGABRT
    assert "radiance-ar watchdog: rank 0: peer rank 1 did not post flag ready." in proc.stderr
    assert "RADIANCE_AR_WATCHDOG_S sets the limit" in proc.stderr
    assert "a clean-up before the stop failed: FileNotFoundError" in proc.stderr
    assert not job.exists()


def test_a_check_under_way_pauses_the_clock():
    # check() bounds the call itself (and releases or raises): no stop meanwhile, however
    # long the check's own bound
    s = Stalled()
    s.call()
    assert not s.poll_at(0.0)
    s.signals.checking = True
    assert [s.poll_at(t) for t in (6.0, 60.0)] == [False, False]
    s.signals.checking = False
    assert [s.poll_at(t) for t in (61.0, 65.9, 66.1)] == [False, False, True]


def test_after_many_unchecked_calls_it_names_the_newest_one():
    # A serving engine never checks: the waits of 300 completed calls are still kept (their
    # ring slots reused since), and the error must name call 301, not a long-finished one.
    s = Stalled()
    for _ in range(300):
        s.call(posted=True)
    s.call()
    assert not s.poll_at(0.0) and s.poll_at(6.0)
    assert "for call (epoch) 301 of the test's call" in s.stops[0], s.stops[0]


def test_a_diagnosis_that_fails_still_stops_the_process():
    s = Stalled()
    s.call()

    def broken(waited_s):
        raise KeyError("a header word")

    s.signals.stalled = broken
    assert not s.poll_at(0.0) and s.poll_at(6.0)
    assert "its diagnosis failed (KeyError: 'a header word')" in s.stops[0]


def test_a_watchdog_whose_thread_cannot_set_up_its_gpu_raises_at_construction(monkeypatch):
    """A thread that cannot make its GPU current or relax its capture mode (say the HIP
    runtime's library will not load) would watch nothing while the gates trusted it: the
    constructor raises, naming the cause and the knob, and leaves no thread behind."""
    from radiance_ar.transport import watchdog
    from radiance_ar.transport.runtime_errors import CopyEngineError

    def fails(device):
        raise CopyEngineError("hipThreadExchangeStreamCaptureMode: the HIP runtime could not "
                              "be loaded")

    monkeypatch.setattr(watchdog, "_enter_watch_thread", fails)
    signals, _, _, _ = gpu_signals(2, 0)
    before = set(watchdog._running)
    threads = set(threading.enumerate())
    with pytest.raises(RuntimeError, match=r"could not set up this rank's GPU \(CopyEngineError: "
                                           r"hipThreadExchange.*RADIANCE_AR_WATCHDOG_S=0"):
        Watchdog(signals, 600.0)
    assert set(watchdog._running) == before
    time.sleep(0.1)  # the failed thread has returned once the constructor saw its failure
    assert not [t for t in threading.enumerate() if t not in threads and t.is_alive()]


def test_a_watchdog_dropped_without_close_ends_its_thread():
    signals, _, _, _ = gpu_signals(2, 0)
    dog = Watchdog(signals, 600.0)
    thread = dog._thread
    del dog
    gc.collect()
    thread.join(5 * Watchdog.POLL_S + 1.0)
    assert not thread.is_alive()


def test_a_backend_runs_one_where_its_gate_allows_and_refuses_a_bad_limit():
    world = single_world("cpu")
    rt = overlap.build(world, OverlapSettings(True, "sdma", 1, 2, BackendSettings(watchdog_s=600.0)))
    assert rt.backend.watchdog is None
    assert rt.backend.watchdog_reason == "one rank: no call waits on a peer"
    rt.close()
    with pytest.raises(ValueError, match=r"watchdog_s=5.0 \(RADIANCE_AR_WATCHDOG_S\): expected "
                                         r"a finite number in \[10, 86400\], or 0 \(off\)"):
        BackendSettings(watchdog_s=5.0)
