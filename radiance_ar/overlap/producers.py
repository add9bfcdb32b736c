"""GEMM producers: what computes ``y = x @ weight.T`` for a range of rows.

A producer is prepared once per call on the caller's stream (e.g. quantization of
``x``) and then launched per row slice into a given output view, possibly on another
stream. Whatever ``prepare`` decides for the whole input (a per-tensor scale) every
slice shares, so slicing stays exact. The kinds:

- ``bf16``: ``torch.mm`` of a bf16/fp16 activation and weight.
- ``fp8_rowwise``: per-token fp8 e4m3 activation scales, per-channel (or one per-tensor)
  fp8 weight scales, ``torch._scaled_mm`` with rowwise scaling.
- ``fp8_tensorwise``: ONE dynamic fp8 activation scale over the whole input (not per
  slice: a per-slice scale would make the result depend on the slicing), one fp8 weight
  scale, ``torch._scaled_mm`` with tensorwise scaling.
- external kernels registered with :func:`register_external`, which take an explicit
  stream handle (the MXFP4 W4A8 kernel of the deployment this project comes from is of
  that kind).
- producers bound to one model layer (:mod:`radiance_ar.overlap.producer_quant`: the layer's own
  quantized linear method, per slice), added with :func:`bind` under names
  ``quant_method:<layer>``. They are kept apart from the kernels: :func:`names` lists
  kernels only.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from radiance_ar.overlap.fp8_activation import quantize_tokens
from radiance_ar.overlap.scratch import ScratchPool
from radiance_ar.streams import current_stream_handle

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
#: fp8 formats ``fp8_tensorwise`` quantizes the activation into (the weight's own):
#: e4m3fn, and e4m3fnuz where the platform's fp8 is that (vLLM on MI300)
FP8_TENSORWISE_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


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
    #: interior slice bounds are multiples of this many rows (the kernel's alignment needs)
    slice_row_align = 1
    #: K values one weight element holds along its row (2: MXFP4 packs two codes a byte)
    values_per_weight_element = 1

    def check(self, x: torch.Tensor, weight: torch.Tensor,
              weight_scale: torch.Tensor | None) -> None:
        """Caller-facing checks beyond the common ones of ``radiance_ar.overlap.op``."""

    def prepare(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                scratch: ScratchPool) -> Prepared:
        return Prepared(x, weight, None, weight_scale)

    @abc.abstractmethod
    def launch(self, p: Prepared, a: int, b: int, out: torch.Tensor, stream: int) -> None:
        """Write rows ``a:b`` of the product into ``out`` (``b - a`` rows) on ``stream``."""

    def warm_up(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                bounds: Sequence[int], scratch: ScratchPool) -> None:
        """Launch every slice shape of ``bounds`` once on the current stream: the GEMM
        library picks (and may load or compile) a kernel per shape, and ``prepare`` grows
        the scratch, now. Emulated ranks must do this before any rank's stream can park
        on a flag (radiance_ar/harness/emulated.py, rule 1)."""
        p = self.prepare(x, weight, weight_scale, scratch)
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        handle = current_stream_handle(x.device)
        for a, b in zip(bounds[:-1], bounds[1:]):
            self.launch(p, a, b, out[a:b], handle)


class TorchMM(Producer):
    name = "bf16"

    def check(self, x, weight, weight_scale):
        if weight.dtype != x.dtype:
            raise TypeError(f"producer bf16: weight dtype {weight.dtype} must equal x dtype {x.dtype}")
        if weight_scale is not None:
            raise ValueError("producer bf16: weight_scale must be None")

    def launch(self, p, a, b, out, stream):
        torch.mm(p.x[a:b], p.weight.t(), out=out)


def _check_fp8_weight(name: str, weight: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if weight.dtype not in dtypes:
        raise TypeError(f"producer {name}: weight dtype {weight.dtype}, expected one of {dtypes}")
    # _scaled_mm takes the weight as a column-major (K, N) operand: the transpose of a
    # contiguous (N, K). (vLLM keeps fp8 weights as (K, N) views of exactly that.)
    if not weight.is_contiguous():
        raise ValueError(f"producer {name}: weight must be a contiguous (N, K) tensor, got "
                         f"strides {weight.stride()} for shape {tuple(weight.shape)}")
    # torch's CUDA _scaled_mm refuses other shapes (the CPU one takes them): checked here on
    # every device, so a layer it would refuse is not routed and fails at its first forward
    n, k = weight.shape
    if n % 16 or k % 16:
        raise ValueError(f"producer {name}: weight (N, K) = ({n}, {k}): torch._scaled_mm on "
                         "GPUs needs N and K multiples of 16")


class ScaledMMRowwise(Producer):
    name = "fp8_rowwise"
    needs_weight_scale = True
    # Slices start on multiples of 16 rows: on the H200 cuBLASLt fails a 333-row slice of
    # a 1000-row call with CUBLAS_STATUS_NOT_SUPPORTED (the whole call and 16-row-aligned
    # slices run). The likely cause: cuBLASLt fp8 wants 16-byte aligned operands, and a
    # slice of the fp32 per-token scales is aligned only at multiples of 4 rows; 16 also
    # keeps fp8 rows tile-aligned.
    slice_row_align = 16

    def check(self, x, weight, weight_scale):
        _check_fp8_weight(self.name, weight, (FP8,))
        if x.dtype != torch.bfloat16:  # as mxfp4_routes.cublas_refusal says of the same GEMM
            raise ValueError(f"producer fp8_rowwise: x is {x.dtype}; torch._scaled_mm's "
                             "row-wise scaling writes bf16 on GPUs")
        n = weight.shape[0]
        if (weight_scale is None or weight_scale.dtype != torch.float32
                or weight_scale.shape not in ((n,), (), (1,))):
            raise ValueError(f"producer fp8_rowwise: weight_scale must be float32 of shape "
                             f"({n},), one scale per output channel, or one per-tensor "
                             f"scale (shape () or (1,)); got "
                             + ("None" if weight_scale is None else
                                f"{weight_scale.dtype} {tuple(weight_scale.shape)}"))

    def prepare(self, x, weight, weight_scale, scratch):
        # Per-token scales: a per-call tensor on the caller's stream (the pipeline orders
        # the caller's stream after every side-stream read before returning).
        x8, x_scale = quantize_tokens(x, scratch.get("x_fp8", tuple(x.shape), FP8, x.device))
        x_scale = x_scale.unsqueeze(1)
        # Rowwise _scaled_mm takes a (1, N) weight scale: a per-tensor one (vLLM's
        # Fp8LinearMethod) is broadcast into a per-call tensor, read at every call so a
        # weight reload that rewrites the scale is seen.
        w_scale = weight_scale.reshape(1, -1)
        if w_scale.shape[1] != weight.shape[0]:
            w_scale = w_scale.expand(1, weight.shape[0]).contiguous()
        return Prepared(x8, weight, x_scale, w_scale)

    def launch(self, p, a, b, out, stream):
        torch._scaled_mm(p.x[a:b], p.weight.t(), scale_a=p.x_scale[a:b],
                         scale_b=p.weight_scale, out_dtype=out.dtype, out=out)


class ScaledMMTensorwise(Producer):
    """vLLM's dynamic per-tensor fp8 scheme with the scale taken over the WHOLE input.

    Slicing the layer's own apply would give every slice its own activation scale and
    make the result depend on the slicing: measured on the CPU, a Gaussian 2048 x 1024
    bf16 input, 2 to 8 slices against the unsliced call, 3.1-3.8% relative RMS drift,
    as large as the fp8 rounding error itself, on 50-88% of the rows. Here ``prepare``
    takes one scale over all M rows, as the unsliced layer does, and every slice uses
    it: sliced equals unsliced.
    """

    name = "fp8_tensorwise"
    needs_weight_scale = True

    def check(self, x, weight, weight_scale):
        _check_fp8_weight(self.name, weight, FP8_TENSORWISE_DTYPES)
        if (weight_scale is None or weight_scale.dtype != torch.float32
                or weight_scale.numel() != 1):
            raise ValueError("producer fp8_tensorwise: weight_scale must be ONE float32 "
                             "per-tensor scale (shape () or (1,)); got "
                             + ("None" if weight_scale is None else
                                f"{weight_scale.dtype} {tuple(weight_scale.shape)}"))

    def prepare(self, x, weight, weight_scale, scratch):
        fp8_max = torch.finfo(weight.dtype).max
        x_scale = (x.abs().amax().float() / fp8_max).clamp_min(1e-12).reshape(1)
        x8 = scratch.get("x_fp8", tuple(x.shape), weight.dtype, x.device)
        torch.div(x.float(), x_scale, out=x8)
        return Prepared(x8, weight, x_scale, weight_scale.reshape(1))

    def launch(self, p, a, b, out, stream):
        torch._scaled_mm(p.x[a:b], p.weight.t(), scale_a=p.x_scale, scale_b=p.weight_scale,
                         out_dtype=out.dtype, out=out)


LaunchFn = Callable[[Prepared, int, int, torch.Tensor, int], None]


class External(Producer):
    """A kernel outside torch: ``launch(prepared, a, b, out, stream_handle)``."""

    def __init__(self, name: str, launch: LaunchFn,
                 prepare: Callable[..., Prepared] | None = None, needs_weight_scale: bool = False,
                 values_per_weight_element: int = 1, check: Callable[..., None] | None = None,
                 slice_row_align: int = 1):
        self.name, self._launch, self._prepare = name, launch, prepare
        self.slice_row_align = slice_row_align
        self.needs_weight_scale = needs_weight_scale
        self.values_per_weight_element = values_per_weight_element
        self._check = check

    def check(self, x, weight, weight_scale):
        if self._check is not None:
            self._check(x, weight, weight_scale)

    def prepare(self, x, weight, weight_scale, scratch):
        if self._prepare is None:
            return super().prepare(x, weight, weight_scale, scratch)
        return self._prepare(x, weight, weight_scale, scratch)

    def launch(self, p, a, b, out, stream):
        self._launch(p, a, b, out, stream)


_PRODUCERS: dict[str, Producer] = {
    p.name: p for p in (TorchMM(), ScaledMMRowwise(), ScaledMMTensorwise())}
#: producers bound to one model layer, by name (see the module docstring)
_BOUND: dict[str, Producer] = {}


#: the generic producer's name and its bound producers' prefix (producer_quant.GENERIC):
#: a kernel under it could never be reached by register_producer(X, "quant_method")
RESERVED = "quant_method"


def register_external(name: str, launch: LaunchFn, prepare: Callable[..., Any] | None = None,
                      needs_weight_scale: bool = False, values_per_weight_element: int = 1,
                      check: Callable[..., None] | None = None,
                      slice_row_align: int = 1) -> None:
    """Make an external GEMM kernel usable as ``producer=name`` in ``radiance::linear_ar``
    (``slice_row_align``: interior slice bounds are multiples of it, see :class:`Producer`)."""
    if name in _PRODUCERS or name in _BOUND:
        raise ValueError(f"producer {name!r} is already registered")
    if name.split(":")[0] == RESERVED:
        raise ValueError(f"producer {name!r}: {RESERVED!r} names the generic producer of a "
                         "layer's own apply (radiance_ar/overlap/producer_quant.py); choose "
                         "another name")
    if not isinstance(slice_row_align, int) or slice_row_align < 1:
        raise ValueError(f"register_external: slice_row_align must be a positive int, got "
                         f"{slice_row_align!r}")
    _PRODUCERS[name] = External(name, launch, prepare, needs_weight_scale,
                                values_per_weight_element, check, slice_row_align)


def bind(producer: Producer) -> None:
    """Add (or replace) a producer bound to one layer, under ``producer.name``.

    Replacing is the binder's decision (:func:`radiance_ar.overlap.producer_quant.bind_layer` replaces
    only a producer whose layer is gone); a kernel's name cannot be taken."""
    if producer.name in _PRODUCERS:
        raise ValueError(f"producer {producer.name!r} is a registered kernel; a bound "
                         "producer needs a name of its own")
    _BOUND[producer.name] = producer


def bound(name: str) -> Producer | None:
    """The producer bound under ``name``, or None."""
    return _BOUND.get(name)


def get(name: str) -> Producer:
    prod = _PRODUCERS.get(name)
    if prod is None:
        prod = _BOUND.get(name)
    if prod is None:
        raise ValueError(f"unknown producer {name!r}; registered: {', '.join(_PRODUCERS)}"
                         + (f" (and {len(_BOUND)} bound to layers, quant_method:<layer>)"
                            if _BOUND else ""))
    return prod


def names() -> list[str]:
    """The registered kernel producers (bound ones are not listed)."""
    return list(_PRODUCERS)
