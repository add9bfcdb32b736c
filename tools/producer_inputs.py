"""Each GEMM producer's operands, built from one bf16 shard pair, for both measurement
modes (:mod:`world_measure`, :mod:`emulated_measure`).

- :func:`operands`: the weight in the producer's format: bf16 as is; ``fp8_rowwise`` an
  e4m3 weight with one fp32 scale per output channel, ``fp8_tensorwise`` with one scale
  for the tensor; ``mxfp4_w4a8`` packed e2m1 codes with e8m0 scales per 32 K values
  (:func:`radiance_ar.overlap.producer_mxfp4.quantize_weight`).
- :func:`reference`: the float64 product of the DEQUANTIZED operands: the activation as
  the producer's ``prepare`` quantizes it, the weight as stored. The backends' error
  bounds are about the all-reduce; measured against this reference they still apply,
  while the quantization error itself is the producer's and stays out of the verdict.
- :func:`gemm_alone`: the GEMM as the op runs it unsliced (``prepare``, then one launch
  on the current stream): what ``t_gemm`` times.
- :func:`warm_up`: every slice shape launched once, so that a kernel that compiles or
  loads on first use does so before any emulated rank's stream waits on a flag.
- :func:`unsupported_reason`: why the op cannot run this producer on a device, found by
  running it on tiny operands there (None when it can).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from radiance_ar.streams import current_stream_handle
from radiance_ar.overlap import producer_mxfp4, producers
from radiance_ar.overlap.op import check_inputs
from radiance_ar.overlap.producers import FP8, FP8_MAX
from radiance_ar.overlap.scratch import ScratchPool

_MIN_WEIGHT_SCALE = 1e-12  # an all-zero output channel quantizes to zeros, not NaN


@dataclass
class Operands:
    producer: str
    x: torch.Tensor  # the op's activation, bf16 [M, K]
    weight: torch.Tensor  # the weight in the producer's format
    weight_scale: torch.Tensor | None


def _fp8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1).float() / FP8_MAX).clamp_min(_MIN_WEIGHT_SCALE)
    return (w.float() / scale[:, None]).to(FP8), scale


def _fp8_tensorwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax().float() / FP8_MAX).clamp_min(_MIN_WEIGHT_SCALE).reshape(1)
    return (w.float() / scale).to(FP8), scale


_WEIGHT_FORMATS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]] = {
    "bf16": lambda w: (w, None),
    "fp8_rowwise": _fp8_rowwise,
    "fp8_tensorwise": _fp8_tensorwise,
    producer_mxfp4.NAME: producer_mxfp4.quantize_weight,
}


def _dequantize_weight(ops: Operands) -> torch.Tensor:
    # The operands' weight, not the prepared one: a producer may prepare the weight in
    # another form (mxfp4_w4a8's cuBLAS route widens it to e4m3 over column scales).
    if ops.producer == producer_mxfp4.NAME:
        return producer_mxfp4.dequantize_weight(ops.weight, ops.weight_scale)
    w = ops.weight.double()
    return w if ops.weight_scale is None else w * ops.weight_scale.double().reshape(-1, 1)


def known() -> list[str]:
    """The producers whose operands this module builds."""
    return list(_WEIGHT_FORMATS)


def weight_format(producer: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, weight_scale) in ``producer``'s format, from a bf16 weight ``w`` [N, K]."""
    try:
        fmt = _WEIGHT_FORMATS[producer]
    except KeyError:
        raise ValueError(f"producer_inputs: no weight format for producer {producer!r}; "
                         f"known: {', '.join(known())}") from None
    return fmt(w)


def operands(producer: str, x: torch.Tensor, w: torch.Tensor) -> Operands:
    """The op's inputs for ``producer`` from a bf16 activation ``x`` [M, K] and weight ``w`` [N, K]."""
    return Operands(producer, x, *weight_format(producer, w))


def reference(ops: Operands) -> torch.Tensor:
    """float64 [M, N]: this rank's product of the dequantized operands (module doc)."""
    p = producers.get(ops.producer).prepare(ops.x, ops.weight, ops.weight_scale, ScratchPool())
    x = p.x.double()
    if p.x_scale is not None:
        x = x * p.x_scale.double().reshape(-1, 1)
    return x @ _dequantize_weight(ops).t()


def gemm_alone(ops: Operands, out: torch.Tensor, scratch: ScratchPool,
               xs: Sequence[torch.Tensor] | None = None) -> Callable[[int], None]:
    """``fn(i)``: prepare and launch all rows into ``out`` on the current stream, reading
    ``xs[i % len(xs)]`` (copies of ``ops.x`` that rotate beyond the L2) or ``ops.x``."""
    prod = producers.get(ops.producer)
    inputs = list(xs) if xs else [ops.x]

    def run(i: int) -> None:
        x = inputs[i % len(inputs)]
        p = prod.prepare(x, ops.weight, ops.weight_scale, scratch)
        prod.launch(p, 0, x.shape[0], out, current_stream_handle(x.device))

    return run


def warm_up(ops: Operands, bounds: Sequence[int], scratch: ScratchPool) -> None:
    """Launch every slice shape of ``bounds`` once (compiles/loads the kernels now)."""
    producers.get(ops.producer).warm_up(ops.x, ops.weight, ops.weight_scale, bounds, scratch)


def unsupported_reason(producer: str, device: torch.device) -> str | None:
    """Why ``radiance::linear_ar`` cannot run ``producer`` on ``device`` (its checks or
    its GEMM fail on a 2 x 64 by 32 x 64 product there), or None."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16).to(device)
    # Kernels launch on the current device: under torchrun it is not set yet here.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    try:
        with on_device:
            ops = operands(producer, x, w)
            check_inputs(ops.x, ops.weight, ops.weight_scale, producer)
            gemm_alone(ops, torch.empty(2, 32, dtype=x.dtype, device=device), ScratchPool())(0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as e:  # reported, not swallowed: the caller prints it and stops
        return f"producer {producer} cannot run on {device}: {type(e).__name__}: {e}"
    return None
