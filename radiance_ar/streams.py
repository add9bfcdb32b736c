"""Stream handles and objects: the leaf every layer that enqueues work imports.

Raw handles (integers) are what the copy layer, stream memory operations and external
kernel launches take; torch stream objects are what events and ``torch.cuda.stream``
take. Nothing here imports another module of the package.
"""

from __future__ import annotations

import torch


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream (0 off CUDA/ROCm), as the copy layer
    and external kernels take it. Reading it creates nothing and is legal in capture.
    Read through ``torch._C._cuda_getCurrentRawStream`` where torch has it (as Triton's
    launcher does): ``torch.cuda.current_stream`` builds a Stream object per call, about
    4 us of host time per call on an H200 host (radiance_ar.diagnostics.host_steps)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (False off
    CUDA/ROCm, where the query does not exist)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def stream_object(handle: int, device: torch.device) -> torch.cuda.Stream:
    """The torch stream object of a raw stream handle on ``device`` (to record events on
    it, make it current, wait on it). Handle 0 is the default stream, and
    ``torch.cuda.ExternalStream(0)`` is NOT that stream: torch reads a zero pointer as
    "none given" and hands out a new stream from its pool, so events recorded there run
    ahead of the default stream's work (on an H200, step-trace events recorded there fire
    as the host enqueues them, ahead of a sleep on the default stream)."""
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)
