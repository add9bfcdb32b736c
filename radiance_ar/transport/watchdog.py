"""The watchdog: a GPU rank whose collective calls stop making progress stops its process.

In GPU worlds a stream's flag wait has no timeout of its own; :meth:`GpuSignals.check
<radiance_ar.transport.gpu_signals.GpuSignals.check>` bounds it where someone calls it (the
tools and tests do). A serving engine calls nothing of the kind: between forward passes it
only blocks on a copy of the sampled tokens, so a peer that never posts would leave every
rank's GPU waiting for good. Where each rank is a process of its own (gpu-host, gpu-symm),
one daemon thread per transport watches the newest call its signals enqueued::

    host    : call 41 | call 42 | ... | sampler .cpu() ----------------------- (blocked)
    stream  : call 41 done | call 42 waits on a peer that never posts ..............
    watchdog:   poll   poll   ...   newest call unfinished, nothing enqueued for
                                    RADIANCE_AR_WATCHDOG_S -> abort word, diagnosis, SIGABRT

It stops the process rather than releasing the stream. A released call finishes with
wrong bytes, and the host has already enqueued the work that reads them (the rest of the
forward, the sampler): they would be served before a later call could raise. Stopping on a
collective timeout is what torch's NCCL watchdog does; a process that exits frees its GPU
context, and each peer's own watchdog stops it in turn (their abort words also make peers
that check raise at once).

Progress is the host enqueuing a call or the newest call finishing, so the clock starts
when the host stops enqueuing: a host runs a forward ahead of its GPU, and a long prefill
is not a stall. A rank's first call compiles kernels for seconds (1.0-6.1 s of host in the
gpu-host world: tools/results/2026-12-04-h200-sweep-and-soak/), far inside the default
limit of 300 s, which sits, like NCCL's 10 minutes, well above any healthy wait.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

#: world kinds whose ranks are processes of their own on GPUs (world.KINDS)
WATCHED_KINDS = ("gpu-host", "gpu-symm")


def watchdog_reason(kind: str, limit_s: float) -> str | None:
    """None if a transport in a world of ``kind`` runs a watchdog of ``limit_s`` seconds,
    else why not (a pure gate)."""
    if limit_s == 0:
        return "RADIANCE_AR_WATCHDOG_S=0"
    if kind == "gpu-emulated":
        return ("emulated ranks: one host thread drives every rank, and the tools that use "
                "them bound each call with check()")
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
    process with SIGABRT (no other Python clean-up runs; the driver drops the GPU context
    and its host registrations with the process)."""
    log = logging.getLogger("radiance_ar")
    log.critical("radiance-ar watchdog: %s Stopping this process (SIGABRT); "
                 "RADIANCE_AR_WATCHDOG_S sets the limit, 0 turns the watchdog off.", message)
    for cleanup in _at_stop:
        cleanup()
    for handler in log.handlers + logging.getLogger().handlers:
        handler.flush()
    os.abort()


class Watchdog:
    """A daemon thread that stops the process when ``signals``' newest call (a
    :class:`~radiance_ar.transport.gpu_signals.GpuSignals`) stalls for ``limit_s`` seconds
    (see the module doc). ``stop(message)`` is what it does then (tests record it);
    ``start=False`` leaves polling to the caller (:meth:`poll`)."""

    #: seconds between looks: against a limit of minutes, a stall shows within 0.1 s more,
    #: at one event query (microseconds of host) per look
    POLL_S = 0.1

    def __init__(self, signals: Any, limit_s: float, stop: Callable[[str], None] = stop_process,
                 clock: Callable[[], float] = time.monotonic, start: bool = True):
        if not limit_s > 0:
            raise ValueError(f"Watchdog: limit_s {limit_s!r}: expected seconds > 0")
        self.signals, self.limit_s, self._stop, self._clock = signals, limit_s, stop, clock
        self._progress: int | None = None  # calls enqueued when the newest was first unfinished
        self._since = 0.0
        #: the message it stopped with (None: it has not fired)
        self.fired: str | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radiance-ar watchdog",
                                        daemon=True)
        if start:
            _running.add(self)
            self._thread.start()

    def poll(self) -> bool:
        """One look; True if the newest call had stalled past the limit (``stop`` ran)."""
        event, enqueued = self.signals.last_call()
        if event is None or event.query():
            self._progress = None
            return False
        now = self._clock()
        if self._progress != enqueued:  # a call enqueued since the last look: progress
            self._progress, self._since = enqueued, now
            return False
        if now - self._since < self.limit_s:
            return False
        self.fired = str(self.signals.stalled(now - self._since))
        self._stop(self.fired)
        return True

    def close(self) -> None:
        """Stop watching (the transport closes, or the interpreter exits)."""
        _running.discard(self)
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._closed.wait(self.POLL_S):
            if self.poll():
                return


#: the watchdogs whose thread runs: stopped at exit, before the GPU runtime is torn down
#: under a thread that may be querying an event
_running: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for dog in list(_running):
        dog.close()
