"""Step trace: device events around each transport step of a call, and when the host enqueued it.

A backend that supports tracing (``sdma`` and its composites) wraps each step of a call
(each wait, each copy per peer and phase, the reduce, each publish) in
:meth:`StepTrace.step` when its ``trace`` attribute is set; the timeline tool sets it
for one op call and turns the spans into Gantt lanes. Off (``trace = None``) it costs
one attribute test per step. GPU only: the events are CUDA/HIP events.

Each span keeps the host time at which its start event was enqueued: where a step's
device start follows its host enqueue by almost nothing, the device was waiting for
the host (the call is host-bound), not for a peer or an engine.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from radiance_ar.streams import stream_object


class StepTrace:
    """Spans ``(lane, label, slice, start event, end event, host enqueue time)``."""

    def __init__(self, device: torch.device, lane_names: dict[int, str]):
        """``lane_names``: stream handle -> the lane it is drawn in (unknown handles are
        drawn as ``stream <handle>``)."""
        self.device = torch.device(device)
        self.lane_names = dict(lane_names)
        #: the op slice the next steps belong to (set by the caller of the backend)
        self.slice = 0
        self._spans: list[tuple[str, str, int, torch.cuda.Event, torch.cuda.Event, float]] = []
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _stream(self, handle: int) -> torch.cuda.Stream:
        if handle not in self._streams:
            self._streams[handle] = stream_object(handle, self.device)
        return self._streams[handle]

    @contextlib.contextmanager
    def step(self, label: str, stream: int) -> Iterator[None]:
        """Events around the work the enclosed code enqueues on ``stream`` (``label``:
        the step kind first, e.g. ``"pull 2"``; the summary groups by that first word)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record(self._stream(stream))
        yield
        end.record(self._stream(stream))
        lane = self.lane_names.get(stream, f"stream {stream:#x}")
        self._spans.append((lane, label, self.slice, start, end, host))

    def spans(self, origin: torch.cuda.Event, host_origin: float) -> list[dict]:
        """Every span as ``{lane, label, slice, start_ms, end_ms, host_ms}``, device times
        after ``origin`` and host times after ``host_origin`` (``perf_counter`` taken as
        ``origin`` was recorded). Synchronize the device first."""
        return [{"lane": lane, "label": label, "slice": s, "start_ms": origin.elapsed_time(a),
                 "end_ms": origin.elapsed_time(b), "host_ms": (host - host_origin) * 1e3}
                for lane, label, s, a, b, host in self._spans]


_OFF = contextlib.nullcontext()  # reusable: entering it does nothing


def traced(trace: StepTrace | None, stream: int, *label: object):
    """``trace.step(" ".join(label), stream)``, or nothing when tracing is off (the label
    is only built when tracing: this runs for every step of every call)."""
    return _OFF if trace is None else trace.step(" ".join(map(str, label)), stream)
