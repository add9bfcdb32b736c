"""Two lanes of work: the caller's stream and one side stream, with reusable events.

On a GPU these are CUDA/HIP streams; on the CPU every method is a no-op and work runs
in program order, so the sliced pipeline has one code path for both. Events are
created once per slot and re-recorded: a wait enqueued earlier keeps waiting on the
record it saw, so reuse is safe.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Lanes:
    def __init__(self, device: torch.device):
        self.device = device
        self.gpu = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.gpu else None
        self._events: list[torch.cuda.Event] = []
        #: the caller's stream of the current op call (``side_waits_for_caller`` reads it
        #: once: ``torch.cuda.current_stream`` builds an object per call)
        self._caller: torch.cuda.Stream | None = None

    @property
    def side_handle(self) -> int:
        """The side stream's raw handle (cudaStream_t / hipStream_t), 0 on the CPU."""
        return self.side.cuda_stream if self.side is not None else 0

    def side_waits_for_caller(self) -> None:
        """Start of an op call: the side stream waits for the caller's work so far."""
        if self.side is not None:
            self._caller = torch.cuda.current_stream(self.device)
            if self._caller.cuda_stream == self.side.cuda_stream:
                # torch's pool (32 streams, round robin) gave the caller's stream out again:
                # the GEMMs would queue behind the all-reduces. Take the pool's next one.
                old, self.side = self.side, torch.cuda.Stream(self.device)
                self.side.wait_stream(old)
            self.side.wait_stream(self._caller)

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        if self.side is None:
            yield
        else:
            with torch.cuda.stream(self.side):
                yield

    def mark_side(self, slot: int) -> None:
        """Record event ``slot`` on the side stream."""
        if self.side is None:
            return
        while len(self._events) <= slot:
            self._events.append(torch.cuda.Event())
        self._events[slot].record(self.side)

    def caller_waits_for_side(self) -> None:
        """Make the caller's stream of this op call wait for everything enqueued on the side
        stream so far (a call that failed half way: its later slices' side work was never
        waited for)."""
        if self.side is not None:
            self._caller.wait_stream(self.side)

    def caller_waits(self, slot: int) -> None:
        """Make the caller's stream wait for the last record of event ``slot``."""
        if self.side is not None:
            self._caller.wait_event(self._events[slot])
