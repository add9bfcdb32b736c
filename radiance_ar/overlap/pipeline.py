"""The sliced pipeline: slice s's all-reduce runs while slice s+1's GEMM computes.

Streams (the caller's stream is "main"; roles chosen so that every per-call
tensor -- ``out``, activation scales -- lives on main with a normal lifetime, and only
persistent buffers cross streams)::

    main  : prepare(x) --ev0--+                 wait g0  AR(0)  wait g1  AR(1) ...  return
    side  :                   +-> GEMM(0) -g0-> GEMM(1) -g1-> GEMM(2) -g2-> ...
                                  |              |
                                  v              v
                          y[b0:b1] (peer-visible or scratch)   y[b1:b2] ...

- ``side`` first waits for main (x is prepared; the previous call's ARs, which read
  ``y``, are done), then runs every GEMM slice into ``y`` and marks event ``g_s``.
- A backend may do the first step of slice s's AR on ``side`` too, right after GEMM s
  (``Backend.encode_ahead``: sdma_wht6's encode where its buffers are host memory): a
  kernel ``main`` enqueued there would wait for GEMM s+1's SMs instead.
- ``main`` waits for ``g_s`` and runs the backend's AR of rows ``b_s:b_s+1`` into ``out``,
  every AR inside ``backend.overlapped_calls()``: a backend may start AR s+1 before AR s
  has ended (sdma's two call streams), and ``main`` is ordered after all of them when the
  block ends.
- When it returns, main has waited for every ``g_s``, so it is ordered after every
  side-stream use of ``x``, the scales and ``y``: freeing per-call tensors is safe and no
  record-stream bookkeeping is needed. Nothing is allocated on ``side``.

Host order: every GEMM slice is enqueued before the first AR, not each GEMM one slice
ahead of its AR. In the emulated world (W ranks driven by one host thread) a GEMM
launched after a rank's AR can be the first use of a kernel module, whose load waits for
the device while that rank's AR waits for a peer the host has not reached: interleaved,
the oneshot_wht6 op test timed out on an H200 (tools/results/2026-12-03-h200-codec-host/),
and the host time it would save was not measurable there. Replayed op calls
(:mod:`radiance_ar.overlap.graphs`) pay no per-launch host time at all.

On the CPU the lanes are no-ops and the same code runs in program order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from radiance_ar.backends.interface import Backend
from radiance_ar.overlap.lanes import Lanes
from radiance_ar.overlap.producers import Prepared, Producer


def _nothing(s: int) -> None:
    """The hook that does nothing."""


@dataclass(frozen=True)
class SliceHooks:
    """Calls around each slice's GEMM and AR, given the slice's index ``s``.

    ``gemm_before(s)`` / ``gemm_after(s)`` run just before and after GEMM slice s is
    enqueued, with the stream that runs it current (the side stream); ``ar_before(s)``
    runs on the caller's stream once it waits for GEMM s, just before AR slice s is
    enqueued, ``ar_after(s)`` just after. They change nothing the op computes."""

    gemm_before: Callable[[int], None] = _nothing
    gemm_after: Callable[[int], None] = _nothing
    ar_before: Callable[[int], None] = _nothing
    ar_after: Callable[[int], None] = _nothing


def run_sliced(prepared: Prepared, producer: Producer, backend: Backend, y: torch.Tensor,
               out: torch.Tensor, bounds: Sequence[int], lanes: Lanes,
               hooks: SliceHooks | None = None) -> None:
    """Pipeline ``len(bounds) - 1`` slices: GEMM rows into ``y``, AR them into ``out``;
    ``hooks`` around each slice's GEMM and AR (:class:`SliceHooks`)."""
    assert y.shape == out.shape and bounds[0] == 0 and bounds[-1] == out.shape[0]
    slices = len(bounds) - 1
    ahead: list[object | None] = []
    lanes.side_waits_for_caller()
    try:
        with lanes.on_side():  # every GEMM first (module doc: why not interleaved)
            for s in range(slices):
                a, b = bounds[s], bounds[s + 1]
                if hooks is not None:
                    hooks.gemm_before(s)
                producer.launch(prepared, a, b, y[a:b], lanes.side_handle)
                if hooks is not None:
                    hooks.gemm_after(s)
                ahead.append(backend.encode_ahead(y[a:b], a))
                lanes.mark_side(s)
        if hooks is None:
            reduce_slices(backend, y, out, bounds, before=lanes.caller_waits, ahead=ahead)
            return

        def before(s: int) -> None:
            lanes.caller_waits(s)
            hooks.ar_before(s)

        reduce_slices(backend, y, out, bounds, before, hooks.ar_after, ahead)
    except BaseException:
        # The side stream's later GEMMs and encodes were never waited for: the caller's
        # next work (a direct all_reduce writing the same stage rows) must not overtake them.
        lanes.caller_waits_for_side()
        raise


def reduce_slices(backend: Backend, y: torch.Tensor, out: torch.Tensor, bounds: Sequence[int],
                  before: Callable[[int], None] | None = None,
                  after: Callable[[int], None] | None = None,
                  ahead: Sequence[object | None] | None = None) -> None:
    """``out[b_s:b_s+1] = sum over ranks of y[b_s:b_s+1]`` for every slice s, one
    ``all_reduce`` each, as the op calls them: inside ``backend.overlapped_calls()``, so
    slice s+1's AR may start before slice s's ends and the current stream is ordered
    after all of them on return. ``before(s)`` / ``after(s)`` run around slice s's call
    (the op: the wait for GEMM s, then its ``SliceHooks.ar_before`` / ``ar_after``);
    ``ahead[s]``: what ``backend.encode_ahead`` did for slice s (``all_reduce_ahead``
    then finishes it), ``None`` for none."""
    with backend.overlapped_calls():
        for s in range(len(bounds) - 1):
            a, b = bounds[s], bounds[s + 1]
            if before is not None:
                before(s)
            done_ahead = ahead[s] if ahead is not None else None
            if done_ahead is None:
                backend.all_reduce(y[a:b], out[a:b])
            else:
                backend.all_reduce_ahead(y[a:b], out[a:b], done_ahead)
            if after is not None:
                after(s)
