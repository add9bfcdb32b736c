"""The watchdog: a GPU rank whose collective calls stop making progress stops its process.

In GPU worlds a stream's flag wait has no timeout of its own; :meth:`GpuSignals.check
<radiance_ar.transport.gpu_signals.GpuSignals.check>` bounds it where someone calls it (the
tools and tests do). A serving engine calls nothing of the kind: between forward passes it
only blocks on a copy of the sampled tokens, so a peer that never posts would leave every
rank's GPU waiting for good. Where each rank is a process of its own (gpu-host, gpu-symm)
and ``RADIANCE_AR_WATCHDOG_S`` is not 0 (default 600), one daemon thread per backend watches
the newest call its signals enqueued::

    host    : call 41 | call 42 | ... | sampler .cpu() ----------------------- (blocked)
    stream  : call 41 done | call 42 waits on a peer that never posts ..............
    watchdog:   poll   poll   ...   newest call unfinished, nothing enqueued for
                                    RADIANCE_AR_WATCHDOG_S -> abort word, diagnosis, SIGABRT

It stops the process rather than releasing the stream. A released call finishes with
wrong bytes, and the host has already enqueued the work that reads them (the rest of the
forward, the sampler): they would be served before a later call could raise. Stopping on a
collective timeout is what torch's NCCL watchdog does; a process that exits frees its GPU
context, and each peer's own watchdog stops it in turn (where flags are host memory, its
abort word also makes peers that check raise at once).

Op calls inside a CALLER's CUDA graph run no host code, so the graph counts them on the
device (:mod:`radiance_ar.transport.caller_graphs`): one entered and not left, with neither
count moving for the limit, stops the process alike.

Progress is the host enqueuing a call or the newest call finishing, so the clock starts
when the host stops enqueuing: a host runs a forward ahead of its GPU, and a long prefill
is not a stall. ``check()`` pauses the clock (it bounds the call itself). A rank's first
call compiles kernels for seconds (1.0-6.1 s of host in the gpu-host world:
tools/results/2026-12-04-h200-sweep-and-soak/), and start-up (compilation, autotuning) can
take minutes, which a limit must exceed: 600 s, NCCL's, is the default (its GPU test,
tests/test_host_world_gpu.py, passed on an H200 on 2026-12-05).

The thread sets its device first (a new thread's current device is 0: a first CUDA call
there would make a context on GPU 0 in every rank) and relaxes its stream-capture mode:
under the default global mode its event queries would be refused while another thread
captures a CUDA graph (vLLM does at start-up), invalidating that capture.
"""

from __future__ import annotations

import atexit
import logging
import os
import resource
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch

from radiance_ar.call_contract import PeerTimeoutError
from radiance_ar.transport.copy_engine import platform

#: world kinds whose ranks are processes of their own on GPUs (world.KINDS)
WATCHED_KINDS = ("gpu-host", "gpu-symm")


def watchdog_reason(kind: str, limit_s: float) -> str | None:
    """None if a backend in a world of ``kind`` runs a watchdog of ``limit_s`` seconds
    (checked by its knob: 0, off, or :data:`radiance_ar.envs.WATCHDOG_S_MIN` at least),
    else why not (a pure gate)."""
    if limit_s == 0:
        return "RADIANCE_AR_WATCHDOG_S=0 (off)"
    if kind == "gpu-emulated":
        return ("emulated ranks: one host thread drives every rank, and the tools that use "
                "them bound each call with check()")
    if kind == "single":
        return "one rank: no call waits on a peer"
    if kind not in WATCHED_KINDS:
        return f"a {kind} world waits on the host, bounded by RADIANCE_AR_SPIN_TIMEOUT_MS"
    return None


#: what a stop removes first (:func:`run_at_stop`): ``weakref.finalize`` objects, each
#: run once whoever calls it first
_at_stop: list[weakref.finalize] = []


def run_at_stop(cleanup: weakref.finalize) -> None:
    """Have :func:`stop_process` run ``cleanup`` before it stops the process (rank 0's job
    directory: the job's shared files are unlinked once mapped, the directory at exit)."""
    _at_stop[:] = [c for c in _at_stop if c.alive] + [cleanup]


def stop_process(message: str) -> None:
    """Log ``message`` as the reason, run the clean-ups of :func:`run_at_stop` and stop this
    process with SIGABRT, writing no core file (a CUDA process's core is its pinned memory
    too, and peers see it alive until it is written). No other Python clean-up runs; the
    driver drops the GPU context and its host registrations with the process."""
    log = logging.getLogger("radiance_ar")
    log.critical("radiance-ar watchdog: %s Stopping this process (SIGABRT); "
                 "RADIANCE_AR_WATCHDOG_S sets the limit, 0 turns the watchdog off.", message)
    for cleanup in _at_stop:
        try:
            cleanup()
        except BaseException as e:  # noqa: BLE001 -- a failed clean-up must not cancel the stop
            log.error("radiance-ar watchdog: a clean-up before the stop failed: %s: %s",
                      type(e).__name__, e)
    for handler in log.handlers + logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def _enter_watch_thread(device: torch.device | None) -> None:
    """The watchdog thread's CUDA set-up (see the module doc)."""
    if device is None or device.type != "cuda":
        return
    torch.cuda.set_device(device)
    if platform(device) == "hip":
        from radiance_ar.transport.hip_ops import hip_relax_capture_mode as relax
    else:
        from radiance_ar.transport.cuda_ops import cuda_relax_capture_mode as relax
    relax()


class Watchdog:
    """A daemon thread that stops the process when ``signals``' newest call (a
    :class:`~radiance_ar.transport.gpu_signals.GpuSignals`) stalls for ``limit_s`` seconds
    (see the module doc). ``device``: the rank's GPU, made current on the thread.
    ``stop(message)`` is what it does then (tests record it); ``start=False`` leaves
    polling to the caller (:meth:`poll`)."""

    #: seconds between looks: against a limit of minutes, a stall shows within 0.1 s more,
    #: at one event query (microseconds of host) per look
    POLL_S = 0.1
    #: how long close() waits for the thread (it may sit in a CUDA call)
    JOIN_S = 1.0
    #: how long the constructor waits for the thread's GPU set-up (a context on the device)
    SETUP_S = 60.0

    def __init__(self, signals: Any, limit_s: float, device: torch.device | None = None,
                 stop: Callable[[str], None] = stop_process,
                 clock: Callable[[], float] = time.monotonic, start: bool = True,
                 progress: Any = None):
        """``progress``: the counts of op calls in caller's graphs (a
        :class:`~radiance_ar.transport.caller_graphs.CallerProgress`), watched too."""
        if not limit_s > 0:
            raise ValueError(f"Watchdog: limit_s {limit_s!r}: expected seconds > 0")
        self.signals, self.limit_s, self._stop, self._clock = signals, limit_s, stop, clock
        self.progress = progress
        self._progress: int | None = None  # calls enqueued when the newest was first unfinished
        self._since = 0.0
        #: the caller-graph counts (entered, left) last seen changed, and when
        self._counts: tuple[int, int] | None = None
        self._counts_since = 0.0
        #: the message it stopped with (None: it has not fired)
        self.fired: str | None = None
        self._closed = threading.Event()
        entered, failure = threading.Event(), []
        # The thread holds the watchdog weakly: a backend dropped without close() ends it.
        self._thread = threading.Thread(target=_watch, name="radiance-ar watchdog", daemon=True,
                                        args=(weakref.ref(self), self._closed, device, entered,
                                              failure))
        if start:
            _running.add(self)
            self._thread.start()
            # a thread that cannot set up its GPU would watch nothing, while the gates that
            # trust it (caller_capture_reason) still let unbounded waits into a caller's graph
            entered.wait(self.SETUP_S)
            if failure or not entered.is_set():
                self.close()
                why = (f"{type(failure[0]).__name__}: {failure[0]}" if failure
                       else f"no answer in {self.SETUP_S:.0f} s")
                raise RuntimeError(f"radiance-ar watchdog: its thread could not set up this "
                                   f"rank's GPU ({why}); RADIANCE_AR_WATCHDOG_S=0 turns the "
                                   "watchdog off (and with it captures by a caller)")

    def poll(self) -> bool:
        """One look; True if the newest call, or an op call inside a caller's graph, had
        stalled past the limit (``stop`` ran)."""
        # the graph first: an eager call queued behind a stuck graph stalls too, and its
        # diagnosis would blame the wrong wait
        message = self._caller_graph_stall() or self._eager_stall()
        if message is None:
            return False
        self.fired = message
        self._stop(message)
        return True

    def _eager_stall(self) -> str | None:
        """Why the newest call this host enqueued stalled past the limit, or None."""
        event, enqueued = self.signals.last_call()
        if event is None or self.signals.checking or event.query():
            self._progress = None  # finished, or check() bounds it now
            return None
        now = self._clock()
        if self._progress != enqueued:  # a call enqueued since the last look: progress
            self._progress, self._since = enqueued, now
            return None
        waited = now - self._since
        if waited < self.limit_s:
            return None
        try:
            found = f"the newest call's diagnosis: {self.signals.stalled(waited)}"
        except Exception as e:  # noqa: BLE001 -- the stop must still happen, with what is known
            found = f"its diagnosis failed ({type(e).__name__}: {e})"
        return (f"no progress for {waited:.0f} s with a call unfinished and nothing "
                f"enqueued after it; {found}")

    def _caller_graph_stall(self) -> str | None:
        """Why an op call inside a caller's graph stalled past the limit, or None: one has
        entered and not left, and neither count moved (no host code runs around it)."""
        if self.progress is None:
            return None
        entered, left, ident = self.progress.snapshot()
        if entered == left:
            self._counts = None
            return None
        now = self._clock()
        if self._counts != (entered, left):
            self._counts, self._counts_since = (entered, left), now
            return None
        waited = now - self._counts_since
        if waited < self.limit_s:
            return None
        dead = self.signals.dead_peers()
        who = (f"peer rank(s) {dead} exited" if dead else
               "a peer never posted its tokens, or posted another call's")
        what = (f"the op call of {self.progress.describe(ident)}, inside a caller's CUDA graph, "
                f"made no progress for {waited:.0f} s ({entered} such calls entered, {left} "
                f"left): {who}")
        self.signals.fail(PeerTimeoutError(f"{self.signals.owner}: {what}"))
        return what

    def close(self) -> None:
        """Stop watching (the backend closes, or the interpreter exits)."""
        _running.discard(self)
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.JOIN_S)


def _watch(ref: "weakref.ref[Watchdog]", closed: threading.Event, device: torch.device | None,
           entered: threading.Event, failure: list) -> None:
    try:
        _enter_watch_thread(device)
    except (RuntimeError, OSError) as e:  # the constructor raises it
        failure.append(e)
        return
    finally:
        entered.set()
    try:
        while not closed.wait(Watchdog.POLL_S):
            dog = ref()
            if dog is None or dog.poll():
                return
            del dog  # hold it only while looking
    except (RuntimeError, OSError) as e:  # a CUDA error, or the runtime's: said, not hidden
        logging.getLogger("radiance_ar").error(
            "radiance-ar watchdog: stopped watching this rank's calls: %s: %s",
            type(e).__name__, e)


#: the watchdogs whose thread runs: stopped at exit, before the GPU runtime is torn down
#: under a thread that may be querying an event
_running: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for dog in list(_running):
        dog.close()
