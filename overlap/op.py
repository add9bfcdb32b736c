"""``radiance::linear_ar``: a RowParallel linear and its all-reduce as ONE opaque op.

Plain-torch meaning, for x and weight the rank's shards::

    out = sum over ranks r of (x_r @ weight_r.T)          # M x N, dtype of x

torch.compile sees one node (a fake is registered), so the M-dependent branch, the
streams and the events below are runtime-internal: a shape branch written in Python
around the op would split the compiled graph at every linear (measured ~30% of decode
in the seed). Inside:

- M < RADIANCE_AR_OVERLAP_MIN_M, or backend ``stock``: GEMM, then the vendor
  all-reduce in place. No stream or event API: this arm runs inside decode's captured
  CUDA graphs.
- otherwise: the sliced pipeline of :mod:`overlap.pipeline` with the chosen backend.
"""

from __future__ import annotations

from typing import Optional

import torch

from overlap import producers
from overlap.pipeline import run_sliced
from overlap.producers import Producer
from overlap.runtime import OverlapRuntime, current
from overlap.slicing import slice_bounds

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
                 producer: str) -> Producer:
    """Caller-facing checks of the op's arguments; returns the producer."""
    prod = producers.get(producer)
    if x.dim() != 2:
        raise ValueError(f"radiance::linear_ar: x must be 2-D (tokens, K), got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"radiance::linear_ar: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"radiance::linear_ar: x dtype {x.dtype}, expected one of {ACTIVATION_DTYPES}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"radiance::linear_ar: K mismatch: x has {x.shape[1]} columns, "
                         f"weight (N, K) has K = {weight.shape[1]}")
    if x.shape[0] == 0:
        raise ValueError("radiance::linear_ar: x has 0 rows; expected M >= 1")
    if not x.is_contiguous():
        raise ValueError("radiance::linear_ar: x must be contiguous")
    if weight.device != x.device or (weight_scale is not None and weight_scale.device != x.device):
        raise ValueError(f"radiance::linear_ar: x is on {x.device} but weight is on {weight.device}"
                         + (f" and weight_scale on {weight_scale.device}" if weight_scale is not None else ""))
    prod.check(x, weight, weight_scale)
    return prod


def forward(rt: OverlapRuntime, x: torch.Tensor, weight: torch.Tensor,
            weight_scale: Optional[torch.Tensor], producer: str) -> torch.Tensor:
    """The op's body with its runtime explicit (one runtime per emulated rank)."""
    prod = check_inputs(x, weight, weight_scale, producer)
    if x.device != rt.world.device:
        raise ValueError(f"radiance::linear_ar: x is on {x.device}, this rank's device is "
                         f"{rt.world.device}")
    rows, cols = x.shape[0], weight.shape[0]
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    prepared = prod.prepare(x, weight, weight_scale, rt.scratch)
    backend = rt.backend
    if rows < rt.settings.min_m or not backend.pipelined:
        prod.launch(prepared, 0, rows, out, _current_stream_handle(x.device))
        rt.stock.all_reduce(out, out)
        return out
    backend.ensure_capacity(rows, cols, out.dtype)
    y = (backend.input_view(rows, cols, out.dtype) if backend.peer_visible_input
         else rt.scratch.get("gemm_out", (rows, cols), out.dtype, x.device))
    bounds = slice_bounds(rows, rt.settings.slices)
    run_sliced(prepared, prod, backend, y, out, bounds, rt.lanes())
    return out


def _current_stream_handle(device: torch.device) -> int:
    # Reading the handle creates nothing and is legal during graph capture.
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


@torch.library.custom_op("radiance::linear_ar", mutates_args=())
def linear_ar(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
              producer: str) -> torch.Tensor:
    """``sum over ranks of x @ weight.T`` through this process's runtime (see module doc)."""
    return forward(current(), x, weight, weight_scale, producer)


@linear_ar.register_fake
def _linear_ar_fake(x, weight, weight_scale, producer):
    check_inputs(x, weight, weight_scale, producer)
    return x.new_empty((x.shape[0], weight.shape[0]))
