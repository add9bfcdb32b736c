"""Flags a replayed CUDA graph can carry: one-use tokens with fixed values.

A captured graph replays its stream memory operations with the values they had at
capture. The eager protocol's tags carry the call number (:mod:`radiance_ar.transport.signals`)
and would repeat stale on a replay, so the calls of a captured op call use tokens
instead, as NCCL's copy-engine collectives do:

- every rank owns an INBOX of int64 words, whose low 32 bits stream operations write and
  compare; sender p's token of kind ``ready``, ``reduced`` or ``done`` for the k-th call
  of the graph (or ``entry``, which opens an op call in a caller's graph) lands in word
  (kind, p, k) of the receiver's inbox;
- the sender posts it with a stream write-value of a fixed value into the receiver's
  inbox; the receiver's stream waits until its word equals that value, then writes 0
  back: each token is consumed exactly once, so a later replay's wait cannot pass on an
  earlier replay's token::

    rank p : publish(k) | post ready(k) -> inbox_r       ... fence: wait done(k) in inbox_p, reset
    rank r :          wait ready(k) in inbox_r, reset | pull p(k) | post done(k) -> inbox_p
                                                                         |___________^

Every token posted in a graph is consumed in the same graph: a reader posts done(k) to
each peer after its last pull of call k, and the owner of the bytes consumes it in the
fence of a later call over those bytes or, at the latest, at the graph's end. So a
replay ends only once every peer has read what it published, leaves every inbox zero,
and graphs of any shape may replay in any order, or between eager calls.

The value hashes the kind, k and the call's signature (rows, columns, dtype, M, K and
the layer's number): a peer in another layer or shape posts another value, the wait
never passes, and the host-side bound (:meth:`GpuSignals.check
<radiance_ar.transport.gpu_signals.GpuSignals.check>`) reports the mismatch. A replay
carries no call number; a rank that skipped a whole op call pairs with its peers' next
one, which is caught where the layer numbers differ (the vLLM installer numbers every
layer, so consecutive calls always differ).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from radiance_ar.call_contract import CallSignature, device_tag
from radiance_ar.streams import current_stream_handle

#: calls one captured op call may hold: RADIANCE_AR_OVERLAP_SLICES' upper bound
MAX_CALLS = 64
#: token kinds; ``entry`` only in a caller's graph (:mod:`radiance_ar.transport.caller_graphs`),
#: appended last so the other kinds keep their words and values
KINDS = ("ready", "reduced", "done", "entry")
WORD_BYTES = 8  # int64 words; stream operations write and compare the low 32 bits


def inbox_bytes(world_size: int) -> int:
    """Bytes of one rank's inbox."""
    return len(KINDS) * world_size * MAX_CALLS * WORD_BYTES


def word(kind: str, sender: int, k: int, world_size: int) -> int:
    """The inbox word holding ``sender``'s token of ``kind`` for call ``k`` of a graph."""
    assert 0 <= k < MAX_CALLS, k
    return (KINDS.index(kind) * world_size + sender) * MAX_CALLS + k


def token_value(kind: str, k: int, sig: CallSignature) -> int:
    """The fixed value of a token: never 0 (a consumed word), distinct per kind and k."""
    return device_tag(1 + KINDS.index(kind) * MAX_CALLS + k, sig)


@dataclass(frozen=True)
class Awaited:
    """One wait a graph holds: word ``index`` of this rank's inbox must reach ``value``."""
    index: int
    value: int
    peer: int
    kind: str
    k: int
    sig: CallSignature


@dataclass
class TokenRound:
    """The bookkeeping of one capture (an op call's calls, numbered k = 0, 1, ...)."""
    k: int = -1
    sig: CallSignature | None = None
    #: every token wait the graph holds, for the host-side bound and its message
    awaited: list[Awaited] = field(default_factory=list)
    #: calls whose done tokens every peer will post to this rank, not yet consumed
    unconsumed_done: dict[int, CallSignature] = field(default_factory=dict)
    #: (k, lo, hi): bytes of ``pub`` peers may still read for call k (the fence's entries)
    pending: list[tuple[int, int, int]] = field(default_factory=list)
    #: bytes the graph pulls per replay (the transport's cumulative count)
    pulled_bytes: int = 0
    #: recorded by the graph as its last node (CUDA): a replay has ended once it has
    end_event: Any = None
    #: what the graph's nodes read at every launch, kept as long as the round (ROCm's
    #: batch nodes: :mod:`radiance_ar.transport.hip_capture`)
    node_params: list = field(default_factory=list)

    def begin(self, sig: CallSignature) -> int:
        """A new call of the graph; returns its k."""
        self.k += 1
        if self.k >= MAX_CALLS:
            raise ValueError(f"a captured op call holds at most {MAX_CALLS} all-reduce calls")
        self.sig = sig
        return self.k


class Inbox:
    """One rank's view of every rank's inbox (see the module doc)."""

    def __init__(self, words: list[torch.Tensor], addresses: list[int], rank: int):
        #: every rank's inbox as int64 words (host memory in the emulated world)
        self.words, self.addresses, self.rank = words, addresses, rank
        self.size = len(words)
        self._np = [w.numpy() for w in words] if not words[rank].is_cuda else None

    def address(self, owner: int, kind: str, sender: int, k: int) -> int:
        return self.addresses[owner] + word(kind, sender, k, self.size) * WORD_BYTES

    def read(self, index: int) -> int | None:
        """Word ``index`` of this rank's inbox as the host sees it (None: device memory)."""
        return None if self._np is None else int(self._np[self.rank][index]) & 0xFFFFFFFF

    def write(self, index: int, value: int) -> None:
        """Host write into this rank's inbox (host-visible inboxes only)."""
        if self._np is not None:
            self._np[self.rank][index] = value

    def clear(self) -> None:
        """Zero this rank's inbox (no call in flight: resync, or before the first use)."""
        self.words[self.rank].zero_()
        if self.words[self.rank].is_cuda:
            torch.cuda.synchronize(self.words[self.rank].device)


# ------------------------------------------------------------------ a capture's steps
# ``signals`` is a GpuSignals (its ``capture_round``, ``wait_tokens`` and ``exchange_tokens``),
# ``call_streams`` a CallStreams: the copy transport passes its own
# (CopyTransport.capture_round, .fence).

@contextlib.contextmanager
def capture_round(signals: Any, call_streams: Any, peers: list[int], device: torch.device,
                  end: Callable[[], None], entry: CallSignature | None = None
                  ) -> Iterator[TokenRound]:
    """While a graph of op calls is captured on the current stream: the calls inside
    post and wait tokens, all on the capturing stream (``CallStreams.caller_only``); at
    the end of the block every done token not yet consumed is, on the current stream, so
    the graph ends after every peer has read what it published; then ``end()`` ends the
    capture (on every path). Host state (call numbers, call streams) is as before; the
    round holds what a replay adds.

    ``entry``: the op call's signature where the capture is the CALLER's (one op call;
    :mod:`radiance_ar.transport.caller_graphs`): the graph then begins with the entry
    barrier (every peer's ``entry`` token, which carries ``entry``) and records no end
    event (no host code runs around the caller's replay to read it)."""
    call_streams.forget_calls()
    try:
        with signals.capture_round(end, mark=entry is None) as rnd, call_streams.caller_only():
            stream = current_stream_handle(device)
            if entry is not None:  # one batch: post mine, wait for and consume theirs
                signals.exchange_tokens(peers, "entry", 0, entry, stream)
            yield rnd
            consume_done(signals, rnd, peers, sorted(rnd.unconsumed_done), stream)
            # The graph's last node: the replay's end (check). CUDA only: clr captures an
            # external event record from ROCm 6.4.2 on; there the host records it per replay.
            if entry is None and device.type == "cuda" and not torch.version.hip:
                rnd.end_event = torch.cuda.Event(external=True)
                rnd.end_event.record(torch.cuda.current_stream(device))
    finally:
        call_streams.forget_calls()


def fence(signals: Any, rnd: TokenRound, peers: list[int], lo: int, hi: int,
          stream: int) -> None:
    """The reuse fence inside a capture: ``stream`` waits for (and consumes) the done
    tokens of the round's calls whose bytes of ``pub`` overlap [lo, hi)."""
    hits = [k for k, a, b in rnd.pending if a < hi and lo < b]
    rnd.pending = [x for x in rnd.pending if x[0] not in hits]
    consume_done(signals, rnd, peers, hits, stream)


def consume_done(signals: Any, rnd: TokenRound, peers: list[int], calls: list[int],
                 stream: int) -> None:
    """``stream`` waits for every peer's done token of each of ``calls``, consuming it
    (one batch for all of them: a graph node per 255 operations)."""
    if calls:
        signals.wait_tokens(peers, "done", [(k, rnd.unconsumed_done.pop(k)) for k in calls],
                            stream)
