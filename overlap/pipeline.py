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
- ``main`` waits for ``g_s`` and runs the backend's AR of rows ``b_s:b_s+1`` into ``out``.
- When it returns, main has waited for every ``g_s``, so it is ordered after every
  side-stream use of ``x``, the scales and ``y``: freeing per-call tensors is safe and no
  record-stream bookkeeping is needed. Nothing is allocated on ``side``.

Host order: GEMM(0), GEMM(1), AR(0), GEMM(2), AR(1), ...: each GEMM is enqueued one
slice ahead of the AR that overlaps it, not all of them first. Where enqueueing an AR
takes the host longer than the device needs for a GEMM slice, enqueueing every GEMM
first delayed AR(0) by S - 2 GEMM enqueues while the link sat idle (an H200 timeline of
sdma, 4 emulated ranks: AR(0) started 0.96 ms into an op whose first GEMM took 0.34 ms;
tools/results/2026-12-03-h200-op-host-cost/). The device order is the same either way.

On the CPU the lanes are no-ops and the same code runs in program order.
"""

from __future__ import annotations

import torch

from backends.interface import Backend
from overlap.lanes import Lanes
from overlap.producers import Prepared, Producer


def run_sliced(prepared: Prepared, producer: Producer, backend: Backend, y: torch.Tensor,
               out: torch.Tensor, bounds: list[int], lanes: Lanes) -> None:
    """Pipeline ``len(bounds) - 1`` slices: GEMM rows into ``y``, AR them into ``out``."""
    assert y.shape == out.shape and bounds[0] == 0 and bounds[-1] == out.shape[0]
    slices = len(bounds) - 1

    def gemm(s: int) -> None:
        a, b = bounds[s], bounds[s + 1]
        producer.launch(prepared, a, b, y[a:b], lanes.side_handle)
        lanes.mark_side(s)

    lanes.side_waits_for_caller()
    with lanes.on_side():
        gemm(0)
    for s in range(slices):
        if s + 1 < slices:  # one slice ahead of the AR it overlaps (module doc)
            with lanes.on_side():
                gemm(s + 1)
        a, b = bounds[s], bounds[s + 1]
        lanes.caller_waits(s)
        backend.all_reduce(y[a:b], out[a:b])
