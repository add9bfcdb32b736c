"""The driver of W emulated ranks on one GPU, shared by the tools and the GPU tests.

Emulated ranks (``radiance_ar.transport.world.emulated_worlds``) live in one process and are driven
from one host thread, each on its own persistent stream. Two rules make that safe, and
every user of the world needs both (docs/design.md, 'Worlds'), a third where op calls are
replayed with active peers:

1. Grow every rank's buffers and load every kernel BEFORE any rank's stream can park on
   a peer's flag: a first kernel load (or a cudaFree) synchronizes the device, which
   would wait forever for a stream blocked on a flag that only a later host call posts.
2. Start each rank's work on its stream after the caller's work so far (its inputs are
   ready), and let the caller's stream wait for every rank before it reads a result.
3. Capture every rank's graph of an op call before any rank replays it (:meth:`EmulatedRanks.capture_ahead`):
   a capture made while a peer's replay was parked on this rank blocked in ``capture_end``
   (docs/design.md 3.6).

::

    ranks = EmulatedRanks(4, torch.device("cuda"))
    rts = [overlap.build(w, settings) for w in ranks.worlds]
    ranks.prepare(lambda r: rts[r].backend.ensure_capacity(rows, cols, torch.bfloat16))
    outs = ranks.each(lambda r: overlap.forward(rts[r], xs[r], ws[r], None, "bf16"))
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

import torch

from radiance_ar.transport.copy_engine import dedicated_stream
from radiance_ar.transport.world import World, emulated_worlds

T = TypeVar("T")


class EmulatedRanks:
    """W emulated ranks, their worlds and one persistent stream each."""

    def __init__(self, size: int, device: torch.device):
        self.device = torch.device(device)
        self.worlds: list[World] = emulated_worlds(size, self.device)
        # streams of their own: two ranks on one pool stream deadlock (dedicated_stream)
        self.streams = [dedicated_stream(self.device) for _ in self.worlds]

    @property
    def size(self) -> int:
        return len(self.worlds)

    def prepare(self, grow: Callable[[int], None]) -> None:
        """Rule 1: ``grow(rank)`` for every rank (size buffers, warm kernels and GEMM
        shapes), then a device synchronization while no stream can be parked yet."""
        for rank in range(self.size):
            grow(rank)
        torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def on(self, rank: int) -> Iterator[torch.cuda.Stream]:
        """Run the enclosed work on ``rank``'s stream, after the caller's work so far."""
        stream = self.streams[rank]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield stream

    def join(self) -> None:
        """Rule 2: the caller's stream waits for every rank's work enqueued so far."""
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            caller.wait_stream(stream)

    def capture_ahead(self, caches: list, step: Callable[[int], object]) -> None:
        """Rule 3: ``step(rank)``, an op call due for capture, on every rank's stream with
        that rank's graph cache capturing ahead (``caches[rank]``, its runtime's
        ``graphs()``: :meth:`radiance_ar.overlap.graphs.GraphCache.capturing_ahead`), then
        :meth:`join`, also when a rank raises; the same calls made next replay."""
        try:
            for rank in range(self.size):
                with self.on(rank), caches[rank].capturing_ahead():
                    step(rank)
        finally:
            self.join()

    def each(self, step: Callable[[int], T]) -> list[T]:
        """``step(rank)`` on every rank's stream in rank order, then :meth:`join`."""
        results = []
        for rank in range(self.size):
            with self.on(rank):
                results.append(step(rank))
        self.join()
        return results
