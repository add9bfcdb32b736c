"""Fakes for the host-side logic of GpuSignals on the CPU (tests/test_tokens.py,
tests/test_watchdog.py): flags in CPU tensors (host-visible, as in the gpu-host world),
the stream operations recorded instead of enqueued, events the test completes."""

from __future__ import annotations

import torch

from radiance_ar.transport.gpu_signals import GpuSignals
from radiance_ar.transport.peer_memory import PeerBuffer
from radiance_ar.transport.signals import FLAG_BYTES
from radiance_ar.transport import tokens


class RecordedOps:
    """The stream-operation side of a copy engine, recorded: what a call enqueues."""

    device = torch.device("cpu")  # a test that stands for a GPU sets cuda

    def __init__(self):
        self.batches = []

    def device_address(self, t: torch.Tensor) -> int:
        return t.data_ptr()

    def batch(self, stream: int, ops: list) -> None:
        self.batches.append((stream, list(ops)))

    def stream(self, handle: int) -> int:
        return handle


class StreamBlockedUntil:
    """A stream's end event that completes once ``ready()`` holds: the stream is blocked on
    its waits until then (what a GPU stream waiting on flags does)."""

    def __init__(self, ready=lambda: False):
        self.ready = ready

    def record(self, stream) -> None:
        pass

    def query(self) -> bool:
        return self.ready()


def buffer(name: str, nbytes: int, rank: int, size: int) -> PeerBuffer:
    return PeerBuffer(name, nbytes, rank, [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(size)])


def gpu_signals(size: int, rank: int, timeout_ms: float = 1000.0) -> tuple[GpuSignals, PeerBuffer,
                                                                          PeerBuffer, RecordedOps]:
    """A rank's GpuSignals over host flags and an inbox, with recorded stream operations:
    (signals, flags, inbox, engine)."""
    engine = RecordedOps()
    flags = buffer("flags", FLAG_BYTES, rank, size)
    signals = GpuSignals(flags, rank, size, timeout_ms, engine, "test", lambda: [])
    inbox = buffer("inbox", tokens.inbox_bytes(size), rank, size)
    signals.attach_inbox(inbox)
    return signals, flags, inbox, engine
