"""Signals for GPU worlds: stream write-value / wait-value flags and a host-side bound.

The layout, the tags and the call contract are :mod:`radiance_ar.transport.signals`'; here each post
and wait is a stream memory operation (:mod:`radiance_ar.transport.copy_engine`) executed by the
GPU's front end: no kernel spins. ``ready``/``reduced`` waits are EQ on a 32-bit tag
(NVIDIA compares 32 bits), ``done`` waits a cyclic GEQ. A stream wait-value has NO
timeout of its own; :meth:`GpuSignals.check` is the bound (see :mod:`radiance_ar.transport.signals`).
"""

from __future__ import annotations

import collections
import time

import torch

from radiance_ar.call_contract import (CollectiveMismatchError, PeerAbortedError,
    PeerTimeoutError, device_tag)
from radiance_ar.transport.copy_engine import MASK32, CopyEngine, dedicated_stream
from radiance_ar.transport.peer_memory import PeerBuffer
from radiance_ar.transport.signals import _HEADER, RING, SLOT_BYTES, Signals, _word


class GpuSignals(Signals):
    """Stream write/wait-value flags; host-side bounded :meth:`check` (see the module doc)."""

    #: events kept for check(); only the newest matters (stream order), the ring bounds reuse
    EVENT_RING = 64
    #: stream operations compare 32 bits on NVIDIA: the tag hashes epoch and signature
    #: together (a 64-bit host tag would lose its epoch half in a 32-bit write)
    _make_tag = staticmethod(device_tag)

    def __init__(self, flags: PeerBuffer, rank: int, size: int, timeout_ms: float,
                 engine: CopyEngine, owner: str = "signals"):
        super().__init__(flags, rank, size, timeout_ms, owner)
        self.engine = engine
        self._addr = [engine.device_address(flags.peer(r)) for r in range(size)]
        self._events: list[torch.cuda.Event] = []
        self._last_event: torch.cuda.Event | None = None
        # (peer, slot, epoch, value, what) of the waits enqueued since the last check
        self._awaited: collections.deque = collections.deque(maxlen=4 * RING)

    def post(self, slot: str, epoch: int, stream: int) -> None:
        value = epoch if slot == "done" else self.tag(epoch)
        self.engine.write_value(stream, self._addr[self.rank] + _word(slot, epoch) * SLOT_BYTES,
                                value)

    def wait(self, peer: int, slot: str, epoch: int, stream: int, what: str = "a call") -> None:
        if peer in self._passive or slot == "done":
            value = epoch
            addr = self._addr[peer] + _HEADER["done"] * SLOT_BYTES
            self.engine.wait_value_geq(stream, addr, value)
            slot = "done"
        else:
            value = self.tag(epoch)
            self.engine.wait_value_eq(stream, self._addr[peer] + _word(slot, epoch) * SLOT_BYTES,
                                      value)
        self._awaited.append((peer, slot, epoch, value, what))

    def _read(self, peer: int, word: int) -> int:
        # Flag words hold values < 2**31 in their low half (32-bit writes on NVIDIA).
        return super()._read(peer, word) if self._host_visible else self._read_device_word(
            peer, word)

    def _read_device_word(self, peer: int, word: int) -> int:
        # A stream of its own, never the (possibly blocked) caller's, which a pool stream
        # can be; bounded like everything else.
        probe = dedicated_stream(self.flags.local.device)
        host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(probe):
            host.copy_(self._words[peer][word:word + 1], non_blocking=True)
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
        event.record(self.engine.stream(stream))
        self._last_event = event

    def check(self, timeout_ms: float | None = None) -> None:
        if self._last_event is None:
            return
        bound = self.timeout_ms if timeout_ms is None else timeout_ms
        start = time.monotonic()
        while not self._last_event.query():
            waited_ms = (time.monotonic() - start) * 1000.0
            if waited_ms > bound:
                error = self._diagnose(waited_ms)
                self._drain()
                self.fail(error)
                raise error
            time.sleep(5e-5)
        self._awaited.clear()

    def release(self) -> None:
        """Write every value a wait enqueued since the last :meth:`check` awaits (host-visible
        flags only): no stream stays blocked, whatever the peers did (tests' clean-up)."""
        self._write_awaited(only_unsatisfied=False)
        self._awaited.clear()

    def _write_awaited(self, only_unsatisfied: bool) -> None:
        if not self._host_visible:
            return
        # Later calls reuse ring slots: the earliest awaited value of a slot is written last.
        for peer, slot, epoch, value, _ in reversed(self._awaited):
            if not (only_unsatisfied and self._satisfied(peer, slot, epoch, value)):
                self._np[peer][_word(slot, epoch)] = value

    def _drain(self) -> None:
        """Host-visible flags: release this rank's blocked stream until it has finished.

        One write of the awaited values is not enough: a peer's own delayed posts land in
        the same words later (a tag of ITS call, a lower ``done``) and can undo a release
        the stream had not yet seen, leaving it blocked for good (docs/history.md). So the
        awaited values are written again, every 0.5 ms, while this rank's last call is
        unfinished, bounded by 10 spin bounds."""
        if not self._host_visible:
            return
        deadline = time.monotonic() + max(10 * self.timeout_ms, 1000.0) / 1000.0
        while not self._last_event.query() and time.monotonic() < deadline:
            self._write_awaited(only_unsatisfied=True)
            time.sleep(5e-4)
        self._awaited.clear()

    def _satisfied(self, peer: int, slot: str, epoch: int, value: int) -> bool:
        seen = self._read(peer, _word(slot, epoch))
        return ((seen - value) & MASK32) < 2 ** 31 if slot == "done" else seen == value

    def _in_call(self, peer: int, epoch: int, value: int) -> bool:
        """Whether ``peer``'s header shows it in the very call whose flag (``value``) is
        awaited: then it is stuck or gone inside that call (between two-shot's phases,
        say), not in another call."""
        peer_epoch, sig, _ = self.peer_header(peer)
        return peer_epoch == epoch and sig is not None and self._make_tag(epoch, sig) == value

    def _diagnose(self, waited_ms: float) -> Exception:
        """The error a call that did not finish within the bound raises: who is missing
        (a peer that gave up, one in another call, or one that never posted)."""
        stuck = [a for a in self._awaited if not self._satisfied(*a[:4])]
        if not stuck:
            return PeerTimeoutError(
                f"rank {self.rank}: the stream did not finish within {waited_ms:.0f} ms although "
                "every awaited peer flag is up: the GPU is busy or hung, not waiting on a peer")
        peer, slot, epoch, value, what = stuck[0]
        released = (" The blocked stream was released by writing the awaited flag values "
                    "(so the GPU is not left hung); results of that call are garbage."
                    if self._host_visible else "")
        if self._host_visible and self._read(peer, _HEADER["abort"]):
            return PeerAbortedError(self._aborted_message(peer, what) + released)
        if slot != "done" and self._host_visible and self._read(peer, _HEADER["epoch"]) >= epoch \
                and not self._in_call(peer, epoch, value):
            return CollectiveMismatchError(self._mismatch_message(peer, slot, epoch, what)
                                           + released)
        seen = self._read(peer, _word(slot, epoch))
        also = (f" Also missing: {[(p, s, e) for p, s, e, _, _ in stuck[1:]]}."
                if len(stuck) > 1 else "")
        return PeerTimeoutError(self._timeout_message(peer, slot, epoch, seen, what, waited_ms)
                                + also + released)
