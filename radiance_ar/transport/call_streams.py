"""Where a copy-engine call runs: the caller's stream, or two streams taken in turn.

A two-shot sdma call is a chain on one stream: waits, pulls, the reduce, more waits and
pulls. Between its copies the host link idles (each wait, the reduce, the gaps: about
50 us of a 10 MiB slice's 370 us on the H200, tools/results/2026-12-03-h200-pull-steps/).
With two call streams, consecutive calls run on different streams, so call k+1's pulls
fill call k's idle stretches (the op's slices are independent)::

    caller : -ev_in(k)-+        -ev_in(k+1)-+                    ... (block end) wait end(k), end(k+1)
    call 0 :           +-> [ publish | waits | pulls | reduce | waits | pulls | done(k) ] -end(k)->
    call 1 :                            +-> [ publish | waits | pulls | reduce | ... | (wait end(k)) done(k+1) ] -end(k+1)->

Rules, each for a reason:

- A call's stream first waits for the caller's work so far (``ev_in``): its input.
- ``done`` is one cyclic counter per rank (a peer reads ``done >= t`` as "every call up to
  t is over"), so a call's ``done`` post waits for the previous call's end
  (:meth:`CallStreams.before_done`): never posted out of order.
- Two calls overlap only if they touch disjoint bytes: their byte ranges in the
  transport's buffers (``pub``, ``red`` and the receive slots share one layout) and
  neither writes what the other reads or writes (:class:`Footprint`); else the later
  call also waits for the earlier one's end.
- Outside :meth:`CallStreams.overlapped` the caller's stream waits for each call's end
  before the call returns (the contract of ``all_reduce``); inside it, once, at the
  block's end, for every call of the block. Until then the calls' inputs and outputs must
  stay alive and unwritten (nothing is recorded on these streams).
- Work on a call stream orders only the calls after it on that stream: the transport's
  reuse fence keeps the entries it waited for there (``CopyTransport.fence``), and a
  ``done`` posted off the call streams waits for every call not yet joined.

With ``count`` 1 (``RADIANCE_AR_SDMA_CALL_STREAMS=1``) every call runs on the caller's
stream: one chain, no cross-stream events. Streams are dedicated (never torch's pool: see
:func:`radiance_ar.transport.copy_engine.dedicated_stream`), made when the transport first grows its
buffers, before any call can park a stream. A caller on the default stream has its calls
run on a stream of their own (:class:`OwnStream`), which the bindings' stream operations
order correctly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from radiance_ar.transport.copy_engine import dedicated_stream
from radiance_ar.streams import current_stream_handle


@dataclass(frozen=True)
class Footprint:
    """What one call touches: ``[buf_lo, buf_hi)`` in the transport's buffers (offsets),
    the address ranges ``[in_lo, in_hi)`` it reads and ``[out_lo, out_hi)`` it writes."""
    buf_lo: int
    buf_hi: int
    in_lo: int
    in_hi: int
    out_lo: int
    out_hi: int

    def conflicts(self, earlier: "Footprint") -> bool:
        """Whether this call must wait for ``earlier`` to end (see the module doc)."""
        def meet(a: int, b: int, c: int, d: int) -> bool:
            return a < d and c < b
        return (meet(self.buf_lo, self.buf_hi, earlier.buf_lo, earlier.buf_hi)
                or meet(self.in_lo, self.in_hi, earlier.out_lo, earlier.out_hi)
                or meet(self.out_lo, self.out_hi, earlier.in_lo, earlier.in_hi)
                or meet(self.out_lo, self.out_hi, earlier.out_lo, earlier.out_hi))


class CallStreams:
    """The streams one transport's calls run on (see the module doc): two on a GPU, or
    the caller's alone (``count`` 1)."""

    def __init__(self, device: torch.device, count: int,
                 stream_of: Callable[[int], torch.cuda.Stream] | None):
        """``stream_of``: the torch stream object of a raw handle (the copy engine's cache;
        unused, and may be None, with one stream)."""
        assert count in (1, 2), count
        self.device, self.count, self._stream_of = device, count, stream_of
        self.streams: list[torch.cuda.Stream] = []
        self._in = [torch.cuda.Event() for _ in range(count)] if count > 1 else []
        self._end = [torch.cuda.Event() for _ in range(count)] if count > 1 else []
        self._next = 0  # the stream of the next call
        self._last: tuple[int, Footprint] | None = None  # (stream, footprint) of the last call
        self._depth = 0  # nesting of overlapped()
        self._unjoined: set[int] = set()  # streams whose last call the caller has not waited for
        self._done_after: int | None = None  # the stream whose last end the next done waits for
        self._current: int | None = None  # the handle of the call being enqueued
        self._single = False  # every call on the caller's stream (:meth:`caller_only`)

    def handles(self) -> list[int]:
        """The raw handles of the call streams (made here if not yet)."""
        self._make()
        return [s.cuda_stream for s in self.streams]

    def _make(self) -> None:
        if self.count > 1 and not self.streams:
            self.streams = [dedicated_stream(self.device) for _ in range(self.count)]

    @contextlib.contextmanager
    def call(self, caller: int, footprint: Footprint) -> Iterator[int]:
        """One call: yields the handle its steps go on (``caller`` with one stream)."""
        if self.count == 1 or self._single:
            yield caller
            return
        self._make()
        i, caller_stream = self._next, self._stream_of(caller)
        self._next = (i + 1) % self.count
        stream = self.streams[i]
        self._in[i].record(caller_stream)
        stream.wait_event(self._in[i])
        last, self._last = self._last, (i, footprint)
        if last is not None and last[0] != i and footprint.conflicts(last[1]):
            stream.wait_event(self._end[last[0]])
        self._done_after = last[0] if last is not None and last[0] != i else None
        self._current = stream.cuda_stream
        try:
            yield stream.cuda_stream
        finally:
            self._current = self._done_after = None
            self._end[i].record(stream)
            if self._depth:
                self._unjoined.add(i)
            else:
                caller_stream.wait_event(self._end[i])

    @contextlib.contextmanager
    def caller_only(self) -> Iterator[None]:
        """Every call inside runs on its caller's stream: while a graph is captured. Two
        call streams per rank can block a capture for good: with W = 4 emulated ranks on
        one GPU the capture of the second call blocks at ``capture_end`` while a peer's
        replay waits on this rank (H200, CUDA 13.0; with one stream, or W = 2, it
        completes). Inside a graph the calls' steps are not host-bound, so the second
        stream, which exists to hide host-bound gaps, gains nothing there."""
        self._single = True
        try:
            yield
        finally:
            self._single = False

    def forget_calls(self) -> None:
        """Around a graph capture, with every call joined to the caller: events recorded
        while capturing belong to the graph, so take fresh ones, and let no later call
        wait for a call made before (the caller's stream is ordered after all of them)."""
        assert not self._depth and not self._unjoined, "calls still unjoined"
        if self.count > 1:
            self._in = [torch.cuda.Event() for _ in range(self.count)]
            self._end = [torch.cuda.Event() for _ in range(self.count)]
        self._last, self._next = None, 0

    def before_done(self, stream: int) -> None:
        """Enqueue on ``stream`` the wait that keeps ``done`` posts in call order: in a call
        of :meth:`call`, for the previous call's end where that ran on the other stream; on
        any other stream (a call not entered here), for every call not yet joined."""
        if self.count == 1 or self._single:
            return
        if stream == self._current:
            ends = [] if self._done_after is None else [self._done_after]
        else:
            ends = sorted(self._unjoined)
        for i in ends:
            self._stream_of(stream).wait_event(self._end[i])

    def is_call_stream(self, stream: int) -> bool:
        """Whether ``stream`` is one of the call streams (later calls may run on the other
        one, so work on it orders only the calls that follow it there)."""
        return self.count > 1 and any(s.cuda_stream == stream for s in self.streams)

    @contextlib.contextmanager
    def overlapped(self) -> Iterator[None]:
        """Calls inside may end after they return; the caller's stream (the current
        stream at the block's end) waits for all of them when the block ends, also when
        it raises. Until then a call's input and output must stay alive and unwritten by
        the caller: the allocator is not told that the call streams use them, so
        memory freed inside the block could be handed out again while a call reads it."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._unjoined:
                caller = self._stream_of(current_stream_handle(self.device))
                for i in sorted(self._unjoined):
                    caller.wait_event(self._end[i])
                self._unjoined.clear()


class OwnStream:
    """Where a call from the default stream runs: a dedicated stream of the transport's,
    made at the first such call (``stream``: None until then).

    A stream operation of the CUDA Python bindings given handle 0 does NOT wait for work
    on torch's default stream (H200: a flag write behind a 10 ms sleep lands within 2 ms;
    tools/results/2026-12-03-h200-pm-final/stream_check.log), so such a call's steps go
    here, ordered after the caller's work so far and the caller's later work after them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream: torch.cuda.Stream | None = None

    @contextlib.contextmanager
    def entered(self) -> Iterator[int]:
        """The raw handle a call's steps are enqueued on: the caller's current stream,
        except the default stream (handle 0), for which this stream is current inside
        (for the kernels launched there) and waited for by the caller at the end, also
        when the block raises."""
        handle = current_stream_handle(self.device)
        if handle != 0 or self.device.type != "cuda":
            yield handle
            return
        if self.stream is None:
            self.stream = dedicated_stream(self.device)
        caller, own = torch.cuda.default_stream(self.device), self.stream
        own.wait_stream(caller)
        try:
            with torch.cuda.stream(own):
                yield own.cuda_stream
        finally:
            caller.wait_stream(own)
