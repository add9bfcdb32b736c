"""Signals for GPU worlds: stream write-value / wait-value flags and a host-side bound.

The layout, the tags and the call contract are :mod:`radiance_ar.transport.signals`'; here each post
and wait is a stream memory operation (:mod:`radiance_ar.transport.copy_engine`) executed by the
GPU's front end on NVIDIA: no kernel spins (ROCm's runtime runs each as a one-work-item
kernel: :mod:`radiance_ar.transport.hip_ops`, :mod:`radiance_ar.transport.hip_capture`).
``ready``/``reduced`` waits are EQ on a 32-bit tag (NVIDIA compares 32 bits), ``done``
waits a cyclic GEQ. A stream wait-value has NO timeout of its own; :meth:`GpuSignals.check`
is the bound (see :mod:`radiance_ar.transport.signals`).
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from radiance_ar.call_contract import CallSignature, PeerAbortedError, device_tag
from radiance_ar.transport.copy_engine import CopyEngine, dedicated_stream
from radiance_ar.transport.gpu_diagnosis import GpuDiagnosis
from radiance_ar.transport.runtime_errors import MASK32
from radiance_ar.transport.peer_memory import PeerBuffer
from radiance_ar.transport.signals import _HEADER, RING, SLOT_BYTES, Signals, _word
from radiance_ar.transport.tokens import Awaited, Inbox, TokenRound, token_value, word
from radiance_ar.streams import capturing


class GpuSignals(GpuDiagnosis, Signals):
    """Stream write/wait-value flags; host-side bounded :meth:`check` (see the module doc)."""

    #: events kept for check(); only the newest matters (stream order), the ring bounds reuse
    EVENT_RING = 64
    #: how long a replayed call waits, bound or not, for a peer still capturing its graph:
    #: with 4 processes time-slicing one H200 a capture outlasted a 1000 ms bound
    #: (tools/results/2026-12-04-h200-gpu-host-third/tests_thousand_first_replay_timeout.log)
    CAPTURE_WAIT_MS = 60_000.0
    #: stream operations compare 32 bits on NVIDIA: the tag hashes epoch and signature
    #: together (a 64-bit host tag would lose its epoch half in a 32-bit write)
    _make_tag = staticmethod(device_tag)
    #: the events that mark a call's end (tests of the host-side logic give a fake)
    EVENT_TYPE: Any = torch.cuda.Event
    #: token inboxes of replayed op calls (:meth:`attach_inbox`) and the capture under way
    inbox: Inbox | None = None
    round: TokenRound | None = None

    def __init__(self, flags: PeerBuffer, rank: int, size: int, timeout_ms: float,
                 engine: CopyEngine, owner: str, dead_peers: Callable[[], list[int]]):
        super().__init__(flags, rank, size, timeout_ms, owner, dead_peers)
        self.engine = engine
        self._addr = [engine.device_address(flags.peer(r)) for r in range(size)]
        self._events: list[torch.cuda.Event] = []
        self._last_event: torch.cuda.Event | None = None
        # (peer, slot, epoch, value, what) of the waits enqueued since the last check
        self._awaited: collections.deque = collections.deque(maxlen=4 * RING)
        #: the token waits of the graph replayed last: what :meth:`check` diagnoses
        self._replayed: list[Awaited] = []
        #: the token waits of every graph replayed since the last check, oldest first (the
        #: newest RING): what a release writes, one graph's per pass in turn. Graphs share
        #: inbox words (token k of each), so one graph's values undo another's, and the host
        #: cannot see which one its stream is at; a stream passes them in order, so taking
        #: them in turn frees each (a replay followed by an eager call or another graph
        #: stayed blocked when only the last was kept)
        self._replay_rounds: collections.deque = collections.deque(maxlen=RING)
        self._release_turn = 0
        #: whether a check() is bounding the calls now (the watchdog leaves them to it)
        self.checking = False
        #: the last call a check found complete (a peer's abort of a later one: see check)
        self._checked_epoch = 0

    # ------------------------------------------------------------------ tokens (graphs)

    def attach_inbox(self, buf: PeerBuffer) -> None:
        """Give this rank the token inboxes of :mod:`radiance_ar.transport.tokens` (every
        rank's, in ``buf``), zeroed."""
        self.inbox = Inbox([buf.peer(r)[:buf.nbytes].view(torch.int64) for r in range(self.size)],
                           [self.engine.device_address(buf.peer(r)) for r in range(self.size)],
                           self.rank)
        self.inbox.clear()

    @contextlib.contextmanager
    def capture_round(self, end: Callable[[], None] = lambda: None,
                      mark: bool = True) -> Iterator[TokenRound]:
        """While a graph of op calls is captured: calls post and wait tokens, take no call
        number and record no host event (the round records the graph's own end event:
        :func:`radiance_ar.transport.tokens.capture_round`); host state is as before afterwards.
        ``end()`` ends the capture (``CUDAGraph.capture_end``), on every path.
        Host-visible flags: the header's ``capturing`` word names the call captured, for
        peers that replay it meanwhile (:meth:`check`), until the replay that follows the
        capture takes its number, or the capture fails, ``end()`` included (a mark left
        set would hold peers' bounds at 60 s instead of the spin bound). ``mark=False``: no
        mark (a caller's capture, whose replays no peer's host bounds)."""
        assert self.inbox is not None and self.round is None
        self.round = TokenRound()
        mark = mark and self._host_visible
        if mark:
            self._np[self.rank][_HEADER["capturing"]] = self.epoch + 1
        try:
            try:
                yield self.round
            finally:
                end()
        except BaseException:
            if mark:
                self._np[self.rank][_HEADER["capturing"]] = 0
            raise
        finally:
            self.round = None

    @contextlib.contextmanager
    def call(self, sig: CallSignature) -> Iterator[int]:
        if self.round is None:
            if capturing(self.engine.device):
                raise RuntimeError(
                    f"{self.owner}: an all_reduce called directly inside a CUDA-graph capture: "
                    "its flags would carry this call's numbered tags, which every replay "
                    "repeats, so a peer's wait would pass on a stale tag; capture the op "
                    "(radiance::linear_ar), whose calls in a caller's graph use one-use tokens")
            with super().call(sig) as t:
                yield t
            return
        self.round.begin(sig)
        yield self.epoch

    def post_token(self, kind: str, k: int, sig: CallSignature, stream: int) -> None:
        """Post my token ``kind`` of call ``k`` into every peer's inbox (one batch)."""
        self.engine.batch(stream, self._token_posts(kind, k, sig))

    def exchange_tokens(self, peers: list[int], kind: str, k: int, sig: CallSignature,
                        stream: int) -> None:
        """:meth:`post_token`, then :meth:`wait_tokens` for the same token of ``peers``, in
        ONE batch (a barrier: one graph node on CUDA, where a batch runs in order)."""
        self.engine.batch(stream, self._token_posts(kind, k, sig)
                          + self._token_waits(peers, kind, [(k, sig)]))

    def wait_tokens(self, peers: list[int], kind: str, calls: list[tuple[int, CallSignature]],
                    stream: int) -> None:
        """Later work of ``stream`` waits for the token ``kind`` of each of ``peers`` for
        each (k, signature) of ``calls`` and consumes it: every wait, then every reset, in
        one batch (one graph node on CUDA per 255 operations, 1.6-1.9 us of host per replay
        whatever its size: tools/results/2026-12-04-h200-replay-node-costs/; two on ROCm,
        whose batch node may run its operations concurrently: hip_capture.operation_runs).
        No token is posted again before its reset: a peer posts its next one in a later
        replay, which waits for this rank's tokens of this one."""
        ops = self._token_waits(peers, kind, calls)
        if ops:
            self.engine.batch(stream, ops)

    def _token_posts(self, kind: str, k: int, sig: CallSignature) -> list[tuple[str, int, int]]:
        value = token_value(kind, k, sig)
        return [("write", self.inbox.address(peer, kind, self.rank, k), value)
                for peer in range(self.size) if peer != self.rank]

    def _token_waits(self, peers: list[int], kind: str,
                     calls: list[tuple[int, CallSignature]]) -> list[tuple[str, int, int]]:
        """Every wait, then every reset, of :meth:`wait_tokens`, each wait of an active peer
        recorded in the round's ``awaited``. A passive peer (timing mode) posts no token:
        its wait is one that passes at once (its done word, GEQ, as in eager calls) and its
        reset a write of 0 to its token's word, so a timed graph holds the operations a
        graph of active peers does (its batch node was missing: timings a world of real
        peers could not reach)."""
        waits, resets = [], []
        for k, sig in calls:
            value = token_value(kind, k, sig)
            for peer in peers:
                addr = self.inbox.address(self.rank, kind, peer, k)
                if peer in self._passive:
                    waits.append(("wait_geq", self._addr[peer] + _HEADER["done"] * SLOT_BYTES, 1))
                    resets.append(("write", addr, 0))
                    continue
                waits.append(("wait_eq", addr, value))
                resets.append(("write", addr, 0))
                self.round.awaited.append(Awaited(word(kind, peer, k, self.size), value, peer,
                                                  kind, k, sig))
        return waits + resets

    def replayed(self, rnd: TokenRound, stream: int) -> None:
        """A graph captured in ``rnd`` was launched on ``stream``: :meth:`check` bounds
        its waits, by the end event the graph records itself (a 2.0 us node against
        5.8-10.4 us for a record from the host: host_pieces.json and the README of
        tools/results/2026-12-04-h200-replay-node-costs/, whose input_node_and_end_event.json
        git keeps: git show 87e1ec7:<that folder>/input_node_and_end_event.json), or one
        recorded now. The eager waits before it (the reuse fence of ``before_replay``)
        stay in the release set."""
        self._replayed = rnd.awaited
        self._replay_rounds.append(rnd.awaited)
        if rnd.end_event is None:
            self._record_end(stream)
        else:
            self._last_event = rnd.end_event

    def post(self, slot: str, epoch: int, stream: int) -> None:
        if self.round is not None:
            if slot == "done":
                self.round.unconsumed_done[self.round.k] = self.round.sig
            self.post_token(slot, self.round.k, self.round.sig, stream)
            return
        value = epoch if slot == "done" else self.tag(epoch)
        self.engine.write_value(stream, self._addr[self.rank] + _word(slot, epoch) * SLOT_BYTES,
                                value)

    def wait(self, peer: int, slot: str, epoch: int, stream: int, what: str = "a call") -> None:
        self.wait_all([peer], slot, epoch, stream, what)

    def wait_all(self, peers: list[int], slot: str, epoch: int, stream: int,
                 what: str = "a call") -> None:
        """Every wait of ``peers`` in one batch (:meth:`Signals.wait_all`): a passive peer
        or a ``done`` is waited for as ``done >= epoch`` (cyclic), a step as its tag; in a
        capture, the call's tokens (:meth:`wait_tokens`)."""
        if self.round is not None:
            assert slot != "done", "token-mode fences consume done tokens (CopyTransport.fence)"
            self.wait_tokens(peers, slot, [(self.round.k, self.round.sig)], stream)
            return
        ops = []
        for peer in peers:
            if peer in self._passive or slot == "done":
                waited, value = "done", epoch
                ops.append(("wait_geq", self._addr[peer] + _HEADER["done"] * SLOT_BYTES, value))
            else:
                waited, value = slot, self.tag(epoch)
                ops.append(("wait_eq", self._addr[peer] + _word(slot, epoch) * SLOT_BYTES, value))
            self._awaited.append((peer, waited, epoch, value, what))
        self.engine.batch(stream, ops)

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
        if self.round is None:
            self._replayed = []  # the newest call is eager: what check diagnoses
            self._record_end(stream)

    def _record_end(self, stream: int) -> None:
        if len(self._events) < self.EVENT_RING:
            self._events.append(self.EVENT_TYPE())
        event = self._events[self.epoch % len(self._events)]
        event.record(self.engine.stream(stream))
        self._last_event = event

    def last_call(self) -> tuple[Any, int]:
        """The event that completes with the newest call enqueued (None: no call yet), and
        the call number, which every call enqueued takes, eager or replayed
        (:mod:`radiance_ar.transport.watchdog`'s progress)."""
        return self._last_event, self.epoch

    def stalled(self, waited_s: float) -> Exception:
        """The watchdog's verdict on the newest call, unfinished for ``waited_s`` with nothing
        enqueued after it: the error naming who is missing, recorded as this rank's fault,
        its abort word set where the flags are host memory (peers that check raise). Its
        stream is NOT released."""
        error = self.diagnose(waited_s * 1000.0, releasing=False)
        self.fail(error)
        return error

    def check(self, timeout_ms: float | None = None) -> None:
        self.checking = True
        try:
            self._check(timeout_ms)
        finally:
            self.checking = False

    def _check(self, timeout_ms: float | None) -> None:
        if self._last_event is None:
            return
        bound = self.timeout_ms if timeout_ms is None else timeout_ms
        start = time.monotonic()
        while not self._last_event.query():
            waited_ms = (time.monotonic() - start) * 1000.0
            if waited_ms > bound and waited_ms <= self.CAPTURE_WAIT_MS \
                    and self._peer_capturing():
                time.sleep(1e-3)  # a peer's capture takes seconds, not microseconds
                continue
            if waited_ms > bound:
                error = self.diagnose(waited_ms)
                # the abort word first: the release below also satisfies the same waits of
                # other peers (W >= 3), which must find it when their stream completes
                self.fail(error)
                self._drain()
                raise error
            time.sleep(5e-5)
        self._forget_waits()
        self._raise_if_released_by_a_peer()

    def _peer_capturing(self) -> bool:
        """A replayed call waits on a live, not aborted peer whose header says it is still
        capturing the graph of this very call (host-visible flags)."""
        if not (self._host_visible and self._replayed):
            return False
        dead = set(self.dead_peers())
        return any(self._read(p, _HEADER["capturing"]) == self.epoch
                   and not self._read(p, _HEADER["abort"])
                   for p in range(self.size)
                   if p != self.rank and p not in self._passive and p not in dead)

    def _raise_if_released_by_a_peer(self) -> None:
        """The calls since the last check completed; raise if a peer gave up on one of
        them meanwhile: its release of its own stream writes the flag values IT awaited,
        which can be the very values this rank's stream awaited from a third rank (W >= 3,
        ranks that disagree on M, a dead rank), so the completion says nothing and the
        results are garbage. Host-visible flags only (a device word: only the peer's own
        stream writes it). A peer's abort word holds ITS newest call, which may be past this
        rank's newest (it had enqueued more when it gave up): any abort past the first call
        since the last check counts (a later call would be refused anyway)."""
        first, last = self._checked_epoch, self.epoch
        self._checked_epoch = last
        if not self._host_visible or first == last:
            return
        for peer in range(self.size):
            if peer != self.rank and peer not in self._passive \
                    and self._read(peer, _HEADER["abort"]) > first:
                error = self.dead_error("a call") or PeerAbortedError(
                    self._aborted_message(peer, "a call this rank completed")
                    + " (its release of its own stream may have completed this rank's; the "
                    "results of that call are garbage)")
                self.fail(error)
                raise error

    def release(self) -> None:
        """Write every value a wait enqueued since the last :meth:`check` awaits (host-visible
        flags only): no stream stays blocked, whatever the peers did (tests' clean-up)."""
        self._write_awaited(only_unsatisfied=False)
        self._forget_waits()

    def _forget_waits(self) -> None:
        """Every wait enqueued so far finished (or was released): none is bounded any more."""
        self._awaited.clear()
        self._replayed = []
        self._replay_rounds.clear()

    def _write_awaited(self, only_unsatisfied: bool) -> None:
        if not self._host_visible:
            return
        if self._replay_rounds:  # one graph's tokens per pass, the graphs in turn
            self._release_turn = (self._release_turn + 1) % len(self._replay_rounds)
            for a in self._replay_rounds[self._release_turn]:
                # a consumed token reads 0 too: resync clears the inbox
                if not (only_unsatisfied and self.inbox.read(a.index) == a.value):
                    self.inbox.write(a.index, a.value)
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
        self._forget_waits()

    def _satisfied(self, peer: int, slot: str, epoch: int, value: int) -> bool:
        seen = self._read(peer, _word(slot, epoch))
        return ((seen - value) & MASK32) < 2 ** 31 if slot == "done" else seen == value

    def resync(self, barrier) -> int:
        top = super().resync(barrier)
        if self.inbox is not None:
            self.inbox.clear()
            barrier()
        return top

