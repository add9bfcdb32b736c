"""Cross-rank flags and epochs for transports that wait without compute units.

Every rank owns a small array of int64 words in peer-visible memory; it only ever
WRITES its own array and only READS its peers'. Layout (``WORDS``)::

    done     the last call whose peer buffers this rank finished reading (an epoch)
    abort    the epoch of a call this rank gave up on (0: none): see call_contract
    epoch    the number of this rank's current call        } the header: host-written,
    sig[4]   its signature (rows, cols, dtype/path, key)   } for peers' checks and messages
    vendor   how many vendor-collective calls it announced }
    capturing  the call whose CUDA graph this rank is capturing (0: none; host-visible
             flags only): a peer replaying that call waits longer for it (gpu_signals)
    ready[R], reduced[R]   tag rings: slot t mod R holds the tag of call t

Steps (see :mod:`radiance_ar.backends.sdma`): ``ready`` (my input slice of call t is published),
``reduced`` (my reduced shard is published, two-shot), ``done`` (I finished reading
every peer's buffers for call t).

Epochs and tags. Collective calls are numbered 1, 2, 3, ... identically on every rank.
``ready`` and ``reduced`` gate READING a peer's data, so they carry the exact call
(:mod:`radiance_ar.call_contract`): a wait accepts only ``tag(t, signature)`` in slot
``t mod R`` and nothing else. A peer is at most one op call of slices ahead (the reuse
fence below bounds it), far fewer than R = 128 calls, so a slot is never overwritten
while a peer may still wait on it. ``done`` gates REUSING my own buffer, so it is a
plain epoch that only grows: a waiter waits for ``done >= epoch`` (cyclic on NVIDIA,
``cuStreamWaitValue32`` GEQ; 64-bit on ROCm and the CPU).

Two implementations:

- :class:`CpuSignals` (CPU worlds, flags in shared-memory files): the host posts with
  a plain store and waits with a Python spin (backing off to 1 ms sleeps so W processes
  share 2 cores), bounded by the backend's ``settings.spin_timeout_ms``; on expiry it
  raises :class:`PeerTimeoutError` naming the missing peer, the slot, the epoch and the call.
  x86-64 keeps stores and loads in order (TSO), so data written before a flag is
  visible to a reader that saw the flag.
- :class:`radiance_ar.transport.gpu_signals.GpuSignals` (GPU worlds): stream write-value /
  wait-value operations (:mod:`radiance_ar.transport.copy_engine`), executed by the GPU's front
  end on NVIDIA: no kernel spins (ROCm's runtime runs each as a one-work-item kernel:
  :mod:`radiance_ar.transport.hip_ops`). Tags are 32-bit hashes of (epoch, signature)
  waited on with EQ. A stream wait-value has NO timeout of its own. The bound is host-side and honest:
  :meth:`~radiance_ar.transport.gpu_signals.GpuSignals.check` waits (polling an event) at most the
  timeout from the moment it is called, then reads the peers' flags and raises naming
  the peer that never posted or is in another call. Where the flags are host memory
  (the emulated world) it first releases the blocked stream by writing the awaited
  values, again and again until that stream finished (at most 10 more bounds), so the
  GPU is not left hung; with flags in device memory (symmetric memory) the stream stays
  blocked until the process exits. A caller that synchronizes the stream itself
  (``torch.cuda.synchronize``)
  before calling ``check`` gets no bound at all.
"""

from __future__ import annotations

import abc
import contextlib
import time
from typing import Callable, Iterator

import torch

from radiance_ar.call_contract import (NO_TAG, CallSignature, CollectiveMismatchError,
    FaultState, PeerAbortedError, PeerTimeoutError, host_tag, tag_epoch)
from radiance_ar.transport.runtime_errors import MASK32
from radiance_ar.transport.peer_memory import PeerBuffer

__all__ = ["Signals", "CpuSignals", "PeerTimeoutError", "FLAG_BYTES", "PASSIVE_EPOCH",
           "SLOTS"]

RING = 128  # tag slots per ring (see the module doc: far more than a peer can be ahead)
_HEADER = {"done": 0, "abort": 1, "epoch": 2, "sig": 3, "vendor": 7, "capturing": 8}
HEADER_WORDS = 16  # two cache lines, the second mostly free
_RING_BASE = {"ready": HEADER_WORDS, "reduced": HEADER_WORDS + RING}
SLOTS = ("ready", "reduced", "done")
SLOT_BYTES = 8
FLAG_BYTES = (HEADER_WORDS + 2 * RING) * SLOT_BYTES  # per rank; a multiple of 64 (cache lines)
#: the done value of a passive (pre-filled) peer: at or above every epoch a run reaches
#: (cyclic 32-bit GEQ holds for epochs < 2**31, i.e. 2**31 collective calls)
PASSIVE_EPOCH = 2 ** 31 - 1


def _word(slot: str, epoch: int) -> int:
    if slot == "done":
        return _HEADER["done"]
    try:
        return _RING_BASE[slot] + epoch % RING
    except KeyError:
        raise ValueError(f"signals: slot {slot!r}, expected one of {', '.join(SLOTS)}") from None


class Signals(abc.ABC):
    """One rank's view of every rank's flags, plus the call (epoch) counter."""

    def __init__(self, flags: PeerBuffer, rank: int, size: int, timeout_ms: float,
                 owner: str, dead_peers: Callable[[], list[int]]):
        if flags.nbytes < FLAG_BYTES:
            raise ValueError(f"signals: flag buffer of {flags.nbytes} B, need {FLAG_BYTES}")
        if not timeout_ms > 0:
            raise ValueError(f"signals: timeout_ms must be > 0, got {timeout_ms}")
        self.flags, self.rank, self.size, self.timeout_ms = flags, rank, size, timeout_ms
        self.owner = owner
        #: the peers whose process has exited (the world's PeerMemory.dead_peers: required, so
        #: that no backend's errors can leave a dead peer unnamed)
        self.dead_peers = dead_peers
        self.epoch = 0
        self.vendor_calls = 0
        self.faults = FaultState(owner)
        self._sig: CallSignature | None = None  # the current call's signature
        self._tag = 0  # the current call's flag value (:meth:`tag`)
        self._passive: set[int] = set()
        self._words = [flags.peer(r)[:FLAG_BYTES].view(torch.int64) for r in range(size)]
        self._host_visible = not flags.local.is_cuda
        #: numpy views of host-visible words: a call's host reads and writes are plain
        #: loads and stores, no torch op or allocation per call (None: device memory)
        self._np = [w.numpy() for w in self._words] if self._host_visible else None

    @property
    def host_visible(self) -> bool:
        """The flags are host memory: the host reads peers' headers (:meth:`peer_header`)."""
        return self._host_visible

    # ------------------------------------------------------------------ calls

    @contextlib.contextmanager
    def call(self, sig: CallSignature) -> Iterator[int]:
        """One collective call: refuses while faulted, numbers the call, publishes its
        header; any error inside records the fault and the abort word, then re-raises."""
        self.faults.refuse_if_faulted()
        if self._host_visible:
            aborted = [p for p in range(self.size) if p != self.rank and p not in self._passive
                       and self._read(p, _HEADER["abort"])]
            if aborted:  # a GPU stream cannot read it: refuse here, before any work is queued
                # ... and before this call takes a number: an epoch that no header shows
                # would leave this rank one ahead of its peers after resync.
                error = PeerAbortedError(self._aborted_message(aborted[0], "an earlier call"))
                self.fail(error)
                raise error
        self.epoch += 1
        try:  # from its number on, a failure is the call's: the peers hear of it
            self._sig = sig
            self._tag = self._make_tag(self.epoch, sig)  # every post/wait of the call uses it
            if self._host_visible:
                self._write_header(sig)
                self._np[self.rank][_HEADER["epoch"]] = self.epoch
                self._np[self.rank][_HEADER["capturing"]] = 0  # a capture of it has ended
            yield self.epoch
        except BaseException as e:
            self.fail(e)
            raise

    def fail(self, error: BaseException) -> None:
        """Enter the fault state and tell the peers (abort word, where the host writes it)."""
        self.faults.record(error)
        if self._host_visible:
            self._np[self.rank][_HEADER["abort"]] = max(self.epoch, 1)

    def _write_header(self, sig: CallSignature) -> None:
        self._np[self.rank][_HEADER["sig"]:_HEADER["sig"] + 4] = sig.words()

    def announce_vendor_call(self, sig: CallSignature) -> None:
        """The decode path is entering the vendor collective (host-visible flags only):
        peers in the sliced path see it and raise instead of waiting out their bound."""
        self.faults.refuse_if_faulted()
        if not self._host_visible:
            return
        self.vendor_calls += 1
        self._write_header(sig)
        self._np[self.rank][_HEADER["vendor"]] = self.vendor_calls

    def joined_vendor_call(self) -> None:
        """This rank joined, with NaN, a vendor call a peer announced and it never made
        (:meth:`missed_vendor_call`): count it, so the counts agree again."""
        self.vendor_calls += 1

    def refuse_if_faulted(self) -> None:
        """Raise if an earlier call failed on this rank (every call is refused until resync)."""
        self.faults.refuse_if_faulted()

    def check_vendor_call(self) -> None:
        """After a vendor collective: raise if a peer gave up meanwhile (its abort word)."""
        if not self._host_visible:
            return
        for p in range(self.size):
            if p != self.rank and self._read(p, _HEADER["abort"]):
                error = PeerAbortedError(self._aborted_message(p, "the vendor all-reduce"))
                self.fail(error)
                raise error

    def missed_vendor_call(self) -> CallSignature | None:
        """The vendor call a peer announced that this rank never made (its count is
        ahead of ours), or None. The op joins it once, with NaN, to release that peer."""
        if not self._host_visible:
            return None
        for p in range(self.size):
            _, sig, vendor = self.peer_header(p)
            if p != self.rank and vendor > self.vendor_calls and sig is not None \
                    and sig.path == "vendor":
                return sig
        return None

    def tag(self, epoch: int) -> int:
        """The flag value of step ``ready``/``reduced`` of the current call ``epoch``."""
        assert epoch == self.epoch and self._sig is not None, "post/wait outside its call"
        return self._tag

    #: host spins read 64-bit tags (epoch and signature apart, for messages)
    _make_tag = staticmethod(host_tag)

    @abc.abstractmethod
    def post(self, slot: str, epoch: int, stream: int) -> None:
        """Publish step ``slot`` of call ``epoch`` once the stream's earlier work is done."""

    @abc.abstractmethod
    def wait(self, peer: int, slot: str, epoch: int, stream: int, what: str) -> None:
        """Later work (of ``stream``) waits until ``peer`` posted ``slot`` of call ``epoch``."""

    def wait_all(self, peers: list[int], slot: str, epoch: int, stream: int, what: str) -> None:
        """:meth:`wait` for each of ``peers`` (GPU signals batch the waits of a graph)."""
        for peer in peers:
            self.wait(peer, slot, epoch, stream, what)

    # ------------------------------------------------------------------ state

    def _read(self, peer: int, word: int) -> int:
        return int(self._np[peer][word])

    def peer_value(self, peer: int, slot: str) -> int:
        """The word as the host reads it now (``done``: the epoch; a ring: the tag of
        the current call's slot). Host-visible flags only."""
        return self._read(peer, _word(slot, self.epoch))

    def peer_header(self, peer: int) -> tuple[int, CallSignature | None, int]:
        """(epoch, signature, vendor calls) of ``peer``'s current call, as it wrote them."""
        words = self._words[peer]
        sig = CallSignature.from_words(words[_HEADER["sig"]:_HEADER["sig"] + 4].tolist())
        return self._read(peer, _HEADER["epoch"]), sig, self._read(peer, _HEADER["vendor"])

    def resync(self, barrier: Callable[[], None]) -> int:
        """Collective, no call in flight on any rank: put every rank back in step after a
        collective error. Every rank's epoch jumps to the largest any rank reached, its
        tag rings and abort word are cleared and its fault state too. Returns the epoch."""
        barrier()
        # a passive peer's done is PASSIVE_EPOCH (set_passive), no call number of any rank
        top = max(max(self._read(p, _HEADER["epoch"]), self._read(p, _HEADER["done"]) & MASK32)
                  for p in range(self.size) if p not in self._passive)
        top = max(top, self.epoch)
        vendor = max(self._read(p, _HEADER["vendor"]) for p in range(self.size))
        barrier()  # every rank has read every word before any rank rewrites its own
        self.epoch, self.vendor_calls = top, vendor
        own = self._words[self.rank]
        own[HEADER_WORDS:].fill_(NO_TAG)
        own[_HEADER["abort"]] = 0
        own[_HEADER["capturing"]] = 0
        own[_HEADER["epoch"]] = top
        own[_HEADER["vendor"]] = vendor
        if self.rank not in self._passive:
            own[_HEADER["done"]] = top
        if own.is_cuda:
            torch.cuda.synchronize(own.device)
        self.faults.clear()
        barrier()
        return top

    def set_passive(self, peer: int) -> None:
        """Timing mode: ``peer`` never calls; waits on it pass at once (its ``done``
        word is raised to :data:`PASSIVE_EPOCH`, which a wait on it reads instead)."""
        self._passive.add(peer)
        self._words[peer][_HEADER["done"]] = PASSIVE_EPOCH

    def passive_peers(self) -> set[int]:
        """The peers made passive by :meth:`set_passive`."""
        return set(self._passive)

    def end_call(self, stream: int) -> None:
        """Mark the end of one collective call on ``stream`` (GPU: for :meth:`check`)."""

    def check(self, timeout_ms: float | None = None) -> None:
        """Host-side bounded wait for every enqueued call; raises naming a missing peer."""

    # ------------------------------------------------------------------ messages

    def _views(self, peer: int) -> str:
        epoch, sig, vendor = self.peer_header(peer)
        mine = self._sig.describe() if self._sig is not None else "no call"
        theirs = sig.describe() if sig is not None else "no call yet"
        return (f"rank {self.rank} is in call {self.epoch}: {mine} (vendor calls "
                f"{self.vendor_calls}); rank {peer} is in call {epoch}: {theirs} (vendor "
                f"calls {vendor})")

    def _timeout_message(self, peer: int, slot: str, epoch: int, seen: int, what: str,
                         waited_ms: float) -> str:
        return (f"rank {self.rank}: peer rank {peer} did not post flag {slot!r} for call "
                f"(epoch) {epoch} of {what} within {waited_ms:.0f} ms (its flag reads {seen}; "
                "RADIANCE_AR_SPIN_TIMEOUT_MS sets the bound): that rank is missing, stuck or "
                "out of step (every rank must make the same collective calls); call resync() "
                "on every rank before the next call")

    def _mismatch_message(self, peer: int, slot: str, epoch: int, what: str) -> str:
        return (f"rank {self.rank}: peer rank {peer}'s flag {slot!r} belongs to another call "
                f"than call (epoch) {epoch} of {what}: {self._views(peer)}. Every rank must "
                "make the same collective calls with the same shapes and paths; call resync() "
                "on every rank before the next call")

    def dead_error(self, what: str) -> PeerTimeoutError | None:
        """The error naming the peers whose process has exited, if any: the cause to name
        before a live peer that waits on them (or gave up waiting)."""
        return dead_peers_error(self.rank, self.dead_peers(), f"call (epoch) {self.epoch} of "
                                f"{what}")

    def _aborted_message(self, peer: int, what: str) -> str:
        return (f"rank {self.rank}: peer rank {peer} gave up on call (epoch) "
                f"{self._read(peer, _HEADER['abort'])} during {what} (its abort word is set), "
                "so this call cannot complete; call resync() on every rank before the next call")


def dead_peers_error(rank: int, dead: list[int], during: str) -> PeerTimeoutError | None:
    """``rank``'s error naming the ``dead`` peers (processes that exited), or None."""
    if not dead:
        return None
    many = len(dead) > 1
    return PeerTimeoutError(
        f"rank {rank}: peer rank{'s' if many else ''} {', '.join(map(str, dead))} "
        f"{'are' if many else 'is'} dead (the process has exited) during {during}; no later "
        "call can complete: restart the job")


class CpuSignals(Signals):
    """Host flags in shared memory; bounded Python spin (see the module doc)."""

    def post(self, slot: str, epoch: int, stream: int = 0) -> None:
        self._np[self.rank][_word(slot, epoch)] = epoch if slot == "done" else self.tag(epoch)

    def wait(self, peer: int, slot: str, epoch: int, stream: int = 0, what: str = "a call") -> None:
        if peer in self._passive:
            return
        words, i = self._np[peer], _word(slot, epoch)
        want = epoch if slot == "done" else self.tag(epoch)
        start = time.monotonic()
        deadline = start + self.timeout_ms / 1000.0
        pause = 1e-5
        while True:
            seen = int(words[i])
            ok = seen >= want if slot == "done" else seen == want
            if words[_HEADER["abort"]]:
                raise self.dead_error(what) or PeerAbortedError(self._aborted_message(peer, what))
            if ok:
                return
            if slot != "done" and seen != NO_TAG and tag_epoch(seen) >= epoch:
                raise CollectiveMismatchError(self._mismatch_message(peer, slot, epoch, what))
            if int(words[_HEADER["vendor"]]) > self.vendor_calls:
                raise CollectiveMismatchError(self._mismatch_message(peer, slot, epoch, what))
            now = time.monotonic()
            if now > deadline:
                raise self.dead_error(what) or PeerTimeoutError(self._timeout_message(
                    peer, slot, epoch, seen, what, (now - start) * 1000.0))
            # Back off: W ranks may share fewer cores than W; a hot spin would starve
            # the very peer it waits for.
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
