"""Persistent, grow-only scratch buffers, one per (device, name).

Why: tensors allocated on a side stream and used across streams are freed late by
torch's record-stream mechanism, and those deferred frees pile up (GEMM outputs and AR
results across 64 layers: more than 1 GiB of dead reserved memory, enough for warm-up
to run out of memory, in the deployment this project comes from; docs/history.md).
Here every cross-stream tensor is a view of one of these buffers, freed only when it
grows, so after warm-up the allocator sees nothing at all. They are allocated on a stream
of the pool's own: a buffer dropped at a growth goes back to that stream's blocks, which
only a later buffer of the pool takes (its first use ordered after every earlier op call:
OverlapRuntime._after_last_stream), never to other work of a caller's stream that a call
on another stream ran beside.
"""

from __future__ import annotations

import contextlib

import torch

from radiance_ar.buffers import grown_size, keep_until_exit, refuse_growth_in_capture
from radiance_ar.transport.copy_engine import dedicated_stream


class ScratchPool:
    """Grow-only byte buffers; :meth:`get` returns typed views into them."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, str], torch.Tensor] = {}
        #: how many times any buffer was (re)allocated; flat after warm-up
        self.growths = 0
        #: a caller's CUDA graph captured views of the buffers: from then on a growth keeps
        #: the old buffer until the process exits (the graph replays its address)
        self.held = False
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """A view of ``shape``/``dtype`` at the start of buffer ``name`` on ``device``.

        Grows the buffer (allocated on the pool's own stream) when it is too small (once ``held``, the
        old one is kept until the process exits); refuses during CUDA-graph capture.
        Contents are whatever the last user left.
        """
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        key = (torch.device(device), name)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            refuse_growth_in_capture(f"scratch buffer {name!r} ({nbytes} B)", key[0])
            # At least 1.5x: a new high M can first come late in a run (docs/history.md).
            grown = grown_size(nbytes, buf.numel() if buf is not None else 0)
            if buf is not None and self.held:  # local to this rank: kept, not refused
                keep_until_exit(buf, f"scratch buffer {name!r} ({buf.numel()} B) replaced")
            # Drop the old buffer first so the allocator can reuse its block (unless kept).
            self._buffers.pop(key, None)
            del buf
            with self._allocating(key[0]):
                buf = torch.empty(grown, dtype=torch.uint8, device=key[0])
            self._buffers[key] = buf
            self.growths += 1
        return buf[:nbytes].view(dtype).view(shape)

    def open(self, device: torch.device) -> None:
        """Make the pool's stream on ``device`` now (nothing on the CPU): the runtime does
        at its build, before any emulated rank's stream can park on a flag. Made at a
        child runtime's first op call instead, with peers parked, its creation
        (``cudaStreamCreateWithFlags``) never returned (H100, ``test_auto_gpu``:
        tools/results/2026-12-05-h100-prefill-bound-and-call-streams/gpu_tests.log)."""
        if device.type == "cuda" and device not in self._streams:
            self._streams[device] = dedicated_stream(device)

    def _allocating(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Where the pool's buffers are allocated: its own stream on a GPU (module doc)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        self.open(device)
        return torch.cuda.stream(self._streams[device])

    def reserved_bytes(self) -> int:
        """Bytes held by every buffer of the pool."""
        return sum(b.numel() for b in self._buffers.values())
