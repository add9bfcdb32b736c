"""GEMM producers: what computes ``y = x @ weight.T`` for a range of rows.

A producer is prepared once per call on the caller's stream (e.g. per-token
quantization of ``x``, row-independent, so slicing it is exact) and then launched per
row slice into a given output view, possibly on another stream. Three kinds:

- ``bf16``: ``torch.mm`` of a bf16/fp16 activation and weight.
- ``fp8_rowwise``: per-token fp8 e4m3 activation scales, per-channel fp8 weight scales,
  ``torch._scaled_mm`` with rowwise scaling.
- external kernels registered with :func:`register_external`, which take an explicit
  stream handle (the MXFP4 W4A8 kernel of the deployment this project comes from is of
  that kind).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable

import torch

from overlap.scratch import ScratchPool

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


@dataclass
class Prepared:
    """What a producer's ``launch`` reads: the (possibly quantized) activation and weights."""
    x: torch.Tensor
    weight: torch.Tensor
    x_scale: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None


class Producer(abc.ABC):
    name: str
    needs_weight_scale = False

    def check(self, x: torch.Tensor, weight: torch.Tensor,
              weight_scale: torch.Tensor | None) -> None:
        """Caller-facing checks beyond the common ones of ``overlap.op``."""

    def prepare(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                scratch: ScratchPool) -> Prepared:
        return Prepared(x, weight, None, weight_scale)

    @abc.abstractmethod
    def launch(self, p: Prepared, a: int, b: int, out: torch.Tensor, stream: int) -> None:
        """Write rows ``a:b`` of the product into ``out`` (``b - a`` rows) on ``stream``."""


class TorchMM(Producer):
    name = "bf16"

    def check(self, x, weight, weight_scale):
        if weight.dtype != x.dtype:
            raise TypeError(f"producer bf16: weight dtype {weight.dtype} must equal x dtype {x.dtype}")
        if weight_scale is not None:
            raise ValueError("producer bf16: weight_scale must be None")

    def launch(self, p, a, b, out, stream):
        torch.mm(p.x[a:b], p.weight.t(), out=out)


class ScaledMMRowwise(Producer):
    name = "fp8_rowwise"
    needs_weight_scale = True

    def check(self, x, weight, weight_scale):
        if weight.dtype != FP8:
            raise TypeError(f"producer fp8_rowwise: weight dtype {weight.dtype}, expected {FP8}")
        if (weight_scale is None or weight_scale.dtype != torch.float32
                or weight_scale.shape != (weight.shape[0],)):
            raise ValueError("producer fp8_rowwise: weight_scale must be float32 of shape "
                             f"({weight.shape[0]},), one scale per output channel")

    def prepare(self, x, weight, weight_scale, scratch):
        # Per-token scales: a per-call tensor on the caller's stream (the pipeline orders
        # the caller's stream after every side-stream read before returning).
        x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        x8 = scratch.get("x_fp8", tuple(x.shape), FP8, x.device)
        torch.div(x.float(), x_scale, out=x8)
        return Prepared(x8, weight, x_scale, weight_scale.view(1, -1))

    def launch(self, p, a, b, out, stream):
        torch._scaled_mm(p.x[a:b], p.weight.t(), scale_a=p.x_scale[a:b],
                         scale_b=p.weight_scale, out_dtype=out.dtype, out=out)


LaunchFn = Callable[[Prepared, int, int, torch.Tensor, int], None]


class External(Producer):
    """A kernel outside torch: ``launch(prepared, a, b, out, stream_handle)``."""

    def __init__(self, name: str, launch: LaunchFn,
                 prepare: Callable[..., Prepared] | None = None, needs_weight_scale: bool = False):
        self.name, self._launch, self._prepare = name, launch, prepare
        self.needs_weight_scale = needs_weight_scale

    def prepare(self, x, weight, weight_scale, scratch):
        if self._prepare is None:
            return super().prepare(x, weight, weight_scale, scratch)
        return self._prepare(x, weight, weight_scale, scratch)

    def launch(self, p, a, b, out, stream):
        self._launch(p, a, b, out, stream)


_PRODUCERS: dict[str, Producer] = {p.name: p for p in (TorchMM(), ScaledMMRowwise())}


def register_external(name: str, launch: LaunchFn, prepare: Callable[..., Any] | None = None,
                      needs_weight_scale: bool = False) -> None:
    """Make an external GEMM kernel usable as ``producer=name`` in ``radiance::linear_ar``."""
    if name in _PRODUCERS:
        raise ValueError(f"producer {name!r} is already registered")
    _PRODUCERS[name] = External(name, launch, prepare, needs_weight_scale)


def get(name: str) -> Producer:
    try:
        return _PRODUCERS[name]
    except KeyError:
        raise ValueError(f"unknown producer {name!r}; registered: {', '.join(_PRODUCERS)}") from None


def names() -> list[str]:
    return list(_PRODUCERS)
