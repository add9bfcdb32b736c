"""Cross-rank flags and epochs for transports that wait without compute units.

Every rank owns a small flag array in peer-visible memory (one 8-byte word per slot,
64 bytes per rank); it only ever WRITES its own array and only READS its peers'.
Slots name protocol steps (see :mod:`backends.sdma`): ``ready`` (my input slice of this
call is published), ``reduced`` (my reduced shard is published, two-shot), ``done``
(I finished reading every peer's buffers for this call).

Epochs. Collective calls are numbered 1, 2, 3, ... identically on every rank
(:meth:`Signals.next_epoch`). A rank posts ``flag = epoch``; a waiter waits for
``flag >= epoch``. Flags only grow, so a flag left over from call t-1 never satisfies a
wait of call t: no flag is ever reset, so no stale value can be seen. The comparison
is cyclic on NVIDIA (``cuStreamWaitValue32`` GEQ is ``(int32)(*addr - v) >= 0``), so
the 32-bit words wrap without harm; ROCm and the CPU use 64-bit words.

Two implementations:

- :class:`CpuSignals` (CPU worlds, flags in shared-memory files): the host posts with
  a plain store and waits with a Python spin (backing off to 1 ms sleeps so W processes
  share 2 cores), bounded by ``RADIANCE_AR_SPIN_TIMEOUT_MS``; on expiry it raises
  :class:`PeerTimeoutError` naming the missing peer, the slot, the epoch and the call.
  x86-64 keeps stores and loads in order (TSO), so data written before a flag is
  visible to a reader that saw the flag.
- :class:`GpuSignals` (GPU worlds): stream write-value / wait-value operations
  (:mod:`backends.copy_engine`), executed by the GPU's front end: no kernel spins.
  A stream wait-value has NO timeout of its own. The bound is host-side and honest:
  :meth:`GpuSignals.check` waits (polling an event) at most the timeout from the moment
  it is called, then reads the peers' flags and raises naming the peer that never
  posted. Where the flags are host memory (the emulated world) it first releases the
  blocked stream by writing the awaited value, so the GPU is not left hung; with
  flags in device memory (symmetric memory) the stream stays blocked until the
  process exits. A caller that synchronizes the stream itself (``torch.cuda.synchronize``)
  before calling ``check`` gets no bound at all.
"""

from __future__ import annotations

import abc
import time
from typing import Callable

import torch

from backends.copy_engine import MASK32, CopyEngine
from backends.peer_memory import PeerBuffer

SLOTS = {"ready": 0, "reduced": 1, "done": 2}
SLOT_BYTES = 8
FLAG_BYTES = 64  # per rank: the slots, padded to a cache line
#: the flag value of a passive (pre-filled) peer: at or above every epoch a run reaches
#: (cyclic 32-bit GEQ holds for epochs < 2**31, i.e. 2**31 collective calls)
PASSIVE_EPOCH = 2 ** 31 - 1


class PeerTimeoutError(RuntimeError):
    """A peer did not post a flag within the spin timeout (the message names it)."""


def _slot(slot: str) -> int:
    try:
        return SLOTS[slot]
    except KeyError:
        raise ValueError(f"signals: slot {slot!r}, expected one of {', '.join(SLOTS)}") from None


class Signals(abc.ABC):
    """One rank's view of every rank's flags, plus the call (epoch) counter."""

    def __init__(self, flags: PeerBuffer, rank: int, size: int, timeout_ms: float):
        if flags.nbytes < FLAG_BYTES:
            raise ValueError(f"signals: flag buffer of {flags.nbytes} B, need {FLAG_BYTES}")
        if not timeout_ms > 0:
            raise ValueError(f"signals: timeout_ms must be > 0, got {timeout_ms}")
        self.flags, self.rank, self.size, self.timeout_ms = flags, rank, size, timeout_ms
        self.epoch = 0
        self._words = [flags.peer(r)[:FLAG_BYTES].view(torch.int64) for r in range(size)]

    def next_epoch(self) -> int:
        """Number of the next collective call (same on every rank)."""
        self.epoch += 1
        return self.epoch

    @abc.abstractmethod
    def post(self, slot: str, epoch: int, stream: int) -> None:
        """Set my flag ``slot`` to ``epoch`` once the stream's earlier work is done."""

    @abc.abstractmethod
    def wait(self, peer: int, slot: str, epoch: int, stream: int, what: str) -> None:
        """Later work (of ``stream``) waits until ``peer``'s flag ``slot`` reaches ``epoch``."""

    def peer_value(self, peer: int, slot: str) -> int:
        """The flag as the host reads it now (reports; host-visible flags only)."""
        return int(self._words[peer][_slot(slot)])

    def resync(self, barrier: Callable[[], None]) -> int:
        """Collective, no call in flight on any rank: put every rank back in step after a
        :class:`PeerTimeoutError`. Every rank's epoch and all of its flags jump to the
        largest flag value any rank reached (flags only grow, so no wait of a later call
        can be satisfied by a flag of an earlier one). Returns that epoch."""
        barrier()
        top = max(self.peer_value(p, slot) for p in range(self.size) for slot in SLOTS)
        barrier()  # every rank has read every flag before any rank raises its own
        self.epoch = top
        own = self._words[self.rank][:len(SLOTS)]
        own.fill_(top)
        if own.is_cuda:
            torch.cuda.synchronize(own.device)
        barrier()
        return top

    def set_passive(self, peer: int) -> None:
        """Raise every flag of ``peer`` to :data:`PASSIVE_EPOCH` (timing with passive peers)."""
        self._words[peer][:len(SLOTS)].fill_(PASSIVE_EPOCH)

    def end_call(self, stream: int) -> None:
        """Mark the end of one collective call on ``stream`` (GPU: for :meth:`check`)."""

    def check(self, timeout_ms: float | None = None) -> None:
        """Host-side bounded wait for every enqueued call; raises naming a missing peer."""

    def _timeout_message(self, peer: int, slot: str, epoch: int, seen: int, what: str,
                         waited_ms: float) -> str:
        return (f"rank {self.rank}: peer rank {peer} did not post flag {slot!r} for call "
                f"(epoch) {epoch} of {what} within {waited_ms:.0f} ms (its flag reads {seen}; "
                "RADIANCE_AR_SPIN_TIMEOUT_MS sets the bound): that rank is missing, stuck or "
                "out of step (every rank must make the same collective calls)")


class CpuSignals(Signals):
    """Host flags in shared memory; bounded Python spin (see the module doc)."""

    def __init__(self, flags: PeerBuffer, rank: int, size: int, timeout_ms: float):
        super().__init__(flags, rank, size, timeout_ms)
        self._np = [w.numpy() for w in self._words]

    def post(self, slot: str, epoch: int, stream: int = 0) -> None:
        self._np[self.rank][_slot(slot)] = epoch

    def wait(self, peer: int, slot: str, epoch: int, stream: int = 0, what: str = "a call") -> None:
        word, i = self._np[peer], _slot(slot)
        if word[i] >= epoch:
            return
        start = time.monotonic()
        deadline = start + self.timeout_ms / 1000.0
        pause = 1e-5
        while word[i] < epoch:
            now = time.monotonic()
            if now > deadline:
                raise PeerTimeoutError(self._timeout_message(
                    peer, slot, epoch, int(word[i]), what, (now - start) * 1000.0))
            # Back off: W ranks may share fewer cores than W; a hot spin would starve
            # the very peer it waits for.
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class GpuSignals(Signals):
    """Stream write/wait-value flags; host-side bounded :meth:`check` (see the module doc)."""

    #: events kept for check(); only the newest matters (stream order), the ring bounds reuse
    EVENT_RING = 64

    def __init__(self, flags: PeerBuffer, rank: int, size: int, timeout_ms: float,
                 engine: CopyEngine):
        super().__init__(flags, rank, size, timeout_ms)
        self.engine = engine
        self._addr = [engine.device_address(flags.peer(r)) for r in range(size)]
        self._host_visible = not flags.local.is_cuda
        self._events: list[torch.cuda.Event] = []
        self._last_event: torch.cuda.Event | None = None
        self._awaited: dict[tuple[int, str], tuple[int, str]] = {}

    def post(self, slot: str, epoch: int, stream: int) -> None:
        self.engine.write_value(stream, self._addr[self.rank] + _slot(slot) * SLOT_BYTES, epoch)

    def wait(self, peer: int, slot: str, epoch: int, stream: int, what: str = "a call") -> None:
        self.engine.wait_value_geq(stream, self._addr[peer] + _slot(slot) * SLOT_BYTES, epoch)
        self._awaited[(peer, slot)] = (epoch, what)

    def peer_value(self, peer: int, slot: str) -> int:
        if self._host_visible:
            value = int(self._words[peer][_slot(slot)])
        else:
            value = self._read_device_flag(peer, slot)
        return value & MASK32 if self.engine.platform == "cuda" else value

    def _read_device_flag(self, peer: int, slot: str) -> int:
        # A side stream, not the (possibly blocked) caller's; bounded like everything else.
        probe = torch.cuda.Stream(self.flags.local.device)
        host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(probe):
            host.copy_(self._words[peer][_slot(slot):_slot(slot) + 1], non_blocking=True)
            done = torch.cuda.Event()
            done.record(probe)
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        while not done.query():
            if time.monotonic() > deadline:
                return -1
            time.sleep(1e-4)
        return int(host[0])

    def end_call(self, stream: int) -> None:
        if len(self._events) < self.EVENT_RING:
            self._events.append(torch.cuda.Event())
        event = self._events[self.epoch % len(self._events)]
        current = torch.cuda.current_stream(self.engine.device)
        event.record(current if current.cuda_stream == stream
                     else torch.cuda.ExternalStream(stream, device=self.engine.device))
        self._last_event = event

    def check(self, timeout_ms: float | None = None) -> None:
        if self._last_event is None:
            return
        bound = self.timeout_ms if timeout_ms is None else timeout_ms
        start = time.monotonic()
        while not self._last_event.query():
            if (time.monotonic() - start) * 1000.0 > bound:
                self._report_missing((time.monotonic() - start) * 1000.0)
            time.sleep(5e-5)
        self._awaited.clear()

    def _report_missing(self, waited_ms: float) -> None:
        stuck = []
        for (peer, slot), (epoch, what) in sorted(self._awaited.items()):
            seen = self.peer_value(peer, slot)
            if seen < epoch:
                stuck.append((peer, slot, epoch, seen, what))
        if not stuck:
            raise PeerTimeoutError(
                f"rank {self.rank}: the stream did not finish within {waited_ms:.0f} ms although "
                "every awaited peer flag is up: the GPU is busy or hung, not waiting on a peer")
        released = ""
        if self._host_visible:
            for peer, slot, epoch, _, _ in stuck:
                self._words[peer][_slot(slot)] = epoch
            released = (" The blocked stream was released by writing the awaited flag values "
                        "(so the GPU is not left hung); results of that call are garbage.")
        peer, slot, epoch, seen, what = stuck[0]
        self._awaited.clear()
        raise PeerTimeoutError(self._timeout_message(peer, slot, epoch, seen, what, waited_ms)
                               + (f" Also missing: {[(p, s, e) for p, s, e, _, _ in stuck[1:]]}."
                                  if len(stuck) > 1 else "") + released)
