"""Which producer computes a vLLM RowParallel linear's GEMM, and from which of its tensors.

:func:`route_for` maps a layer to a :class:`Route` (a producer and the function that
reads the op's ``weight``/``weight_scale`` operands off the layer at every call) or to
the reason it stays stock. The mapping, by the linear method's exact class:

- a class registered with :func:`register_producer` (exact type; wins over the rest);
- ``UnquantizedLinearMethod``: ``bf16`` on a plain 2-D (N, K) float weight; otherwise
  (vLLM's CPU backend repacks the weight for oneDNN) the generic producer;
- vLLM's fp8 methods (:data:`FP8_METHODS`), by their activation quantization:
  per-token dynamic -> ``fp8_rowwise`` (weight (K, N) as vLLM keeps it, so the op gets
  its transpose; one per-tensor or per-channel scale), falling back to the generic
  producer (also exact) where that weight layout is not there (e.g. padded for CUTLASS);
  per-tensor dynamic -> ``fp8_tensorwise`` (one scale over the whole input; the generic
  producer would give each slice its own scale); static scales, per-token-group (block
  fp8) and weight-only Marlin -> the generic producer (row-independent);
- anything else stays stock with its reason: whether a method's activation quantization
  is row-independent cannot be read off it, and slicing one that is not would change
  its results. ``register_producer(Method, "quant_method")`` routes it.

Everything here reads attributes only (duck-typed), so it is testable without vLLM.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from radiance_ar.overlap import producers
from radiance_ar.overlap.producer_quant import GENERIC

#: (layer) -> (weight (N, K), weight_scale or None), called in the routed forward
Operands = Callable[[Any], "tuple[torch.Tensor, torch.Tensor | None]"]
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: vLLM's fp8 linear methods with Fp8LinearMethod's attributes (activation_quant_key,
#: use_marlin; weight (K, N), weight_scale); the Online ones quantize at load time
FP8_METHODS = ("Fp8LinearMethod", "Fp8PerTensorOnlineLinearMethod",
               "Fp8PerBlockOnlineLinearMethod", "Fp8PtpcOnlineLinearMethod")
BUILTIN_METHODS = ("UnquantizedLinearMethod", *FP8_METHODS)
#: where the shape carrier of a generically routed layer lives (radiance_ar.overlap.producer_quant)
CARRIER_ATTR = "radiance_ar_shape"


@dataclass(frozen=True)
class Route:
    """How a layer is routed: ``producer`` is a kernel (``radiance_ar.overlap.producers.names()``) or
    :data:`GENERIC`, bound per layer when it is routed; ``operands`` reads the op's
    tensor arguments off the layer at each call; ``out_features`` is N."""
    producer: str
    operands: Operands
    out_features: int
    why: str = ""


def plain_weight(layer: Any) -> tuple[torch.Tensor, None]:
    return layer.weight, None


def weight_and_scale(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.weight, layer.weight_scale


def fp8_weight_and_scale(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # vLLM keeps an fp8 weight as the (K, N) transpose of a contiguous (N, K), and one
    # per-tensor (shape ()), or per-channel ((N,) or (N, 1)) float32 scale.
    return layer.weight.t(), layer.weight_scale.reshape(-1)


def shape_carrier_operands(layer: Any) -> tuple[torch.Tensor, None]:
    return getattr(layer, CARRIER_ATTR), None


# ---------------------------------------------------------------- user registrations

_REGISTERED: dict[type, tuple[str, Operands | None]] = {}


def register_producer(method_type: type, producer: str, operands: Operands | None = None) -> None:
    """Route layers whose linear method is exactly ``method_type`` through ``producer``.

    - ``producer="quant_method"`` (:data:`GENERIC`): the layer's own
      ``method.apply(layer, x)`` on each row slice. Register a method here only if its
      activation quantization is row-independent (per-token dynamic, static scales,
      weight-only); one with per-tensor dynamic scales would give each slice its own.
    - a kernel producer's name (``radiance_ar.overlap.producers.names()``, including those added
      with ``radiance_ar.overlap.producers.register_external``): ``operands(layer)`` returns the
      op's ``(weight (N, K), weight_scale or None)``, read at every call. Default:
      ``(layer.weight, layer.weight_scale)`` for a producer that needs a weight scale,
      ``(layer.weight, None)`` otherwise.

    Exact type: a subclass may compute something else in ``apply``. A registration wins
    over the built-in mapping, and the last registration of a type wins.
    """
    if not isinstance(method_type, type):
        raise TypeError(f"register_producer: method_type must be a class (the vLLM linear "
                        f"method's type), got {method_type!r} ({type(method_type).__name__})")
    if not isinstance(producer, str):
        raise TypeError(f"register_producer: producer must be a name (str), got {producer!r}")
    if producer == GENERIC:
        if operands is not None:
            raise ValueError(f"register_producer: producer {GENERIC!r} reads the layer through "
                             "its own apply; operands must be None")
    elif producer not in producers.names():
        raise ValueError(f"register_producer: unknown producer {producer!r}; expected "
                         f"{GENERIC!r} or a registered kernel: {', '.join(producers.names())}")
    if operands is not None and not callable(operands):
        raise TypeError(f"register_producer: operands must be callable (layer) -> "
                        f"(weight, weight_scale), got {operands!r}")
    _REGISTERED[method_type] = (producer, operands)


def registered() -> dict[type, str]:
    """The user registrations: linear method class -> producer name."""
    return {t: p for t, (p, _) in _REGISTERED.items()}


# ---------------------------------------------------------------- the mapping

def route_for(layer: Any) -> Route | str:
    """The layer's :class:`Route`, or why no producer computes its GEMM."""
    method = layer.quant_method
    kind = type(method).__name__
    user = _REGISTERED.get(type(method))
    if user is not None:
        producer, operands = user
        if producer == GENERIC:
            scale = getattr(getattr(method, "activation_quant_key", None), "scale", None)
            if (scale is not None and getattr(scale, "static", True) is False
                    and tuple(getattr(scale, "group_shape", ())) == (-1, -1)):
                return (f"quant method {kind} is registered for its own apply, but this "
                        "layer's activation scale is dynamic per-tensor: each slice would "
                        "get its own scale (not row-independent)")
            return _generic(layer, f"registered {kind}")
        if operands is None:
            operands = weight_and_scale if producers.get(producer).needs_weight_scale \
                else plain_weight
        return _kernel(layer, producer, operands, f"registered {kind}")
    if kind == "UnquantizedLinearMethod":
        return _unquantized(layer)
    if kind in FP8_METHODS:
        return _fp8(layer, method, kind)
    known = ", ".join(sorted({*BUILTIN_METHODS, *(t.__name__ for t in _REGISTERED)}))
    return (f"quant method {kind} has no radiance-ar producer (known: {known}); if its "
            f"activation quantization is row-independent, radiance_ar.overlap.vllm_install."
            f"register_producer({kind}, {GENERIC!r}) routes it through its own apply")


def _unquantized(layer: Any) -> Route | str:
    weight = getattr(layer, "weight", None)
    if (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0
            and weight.dtype in WEIGHT_DTYPES and not weight.is_meta):
        return _kernel(layer, "bf16", plain_weight, "unquantized")
    generic = _generic(layer, "unquantized, repacked weight")
    if isinstance(generic, Route):
        return generic
    shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
    return (f"weight is not a plain 2-D (N, K) bf16/fp16/fp32 tensor (shape {shape}, "
            f"{dtype}), e.g. repacked by the platform's GEMM dispatch, and {generic}")


def _fp8(layer: Any, method: Any, kind: str) -> Route | str:
    if getattr(method, "use_marlin", False):
        return _generic(layer, f"{kind}, weight-only (Marlin)")
    scale = getattr(getattr(method, "activation_quant_key", None), "scale", None)
    if scale is None or not hasattr(scale, "static") or not hasattr(scale, "group_shape"):
        return (f"quant method {kind} has no activation_quant_key.scale (static, "
                "group_shape): its activation scaling, and so whether slicing is exact, "
                "is unknown")
    group = tuple(scale.group_shape)
    if scale.static:
        return _generic(layer, f"{kind}, static activation scale")
    if group == (1, -1):
        native = _kernel(layer, "fp8_rowwise", fp8_weight_and_scale, f"{kind}, per-token")
        if isinstance(native, Route):
            return native
        # Per-token scales are row-independent: the layer's own apply is exact too.
        generic = _generic(layer, f"{kind}, per-token ({native})")
        return generic if isinstance(generic, Route) else f"{native}; and {generic}"
    if group == (-1, -1):
        native = _kernel(layer, "fp8_tensorwise", fp8_weight_and_scale,
                         f"{kind}, per-tensor dynamic")
        if isinstance(native, Route):
            return native
        return (f"quant method {kind} has dynamic per-tensor activation scales and "
                f"{native}; its own apply cannot be sliced (each slice would get its own "
                "scale)")
    if len(group) == 2 and group[0] == 1 and group[1] >= 1:
        return _generic(layer, f"{kind}, per-token-group activation scales")
    return (f"quant method {kind} has activation scales of group shape {group}: not "
            "known to be row-independent")


def _kernel(layer: Any, producer: str, operands: Operands, why: str) -> Route | str:
    """A route through a kernel producer, if the layer's operands pass its checks."""
    try:
        weight, weight_scale = operands(layer)
    except (AttributeError, RuntimeError) as e:
        return f"producer {producer}: cannot read its operands off the layer ({e})"
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0
            or weight.is_meta):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        return f"producer {producer}: weight is not a 2-D (N, K) tensor (shape {shape})"
    k = getattr(layer, "input_size_per_partition", weight.shape[1])
    if weight.shape[1] != k:
        return (f"producer {producer}: weight is {tuple(weight.shape)}, not (N, K) with the "
                f"layer's K = {k} (e.g. padded)")
    # The activation's dtype is the model's: the layer's params_dtype in vLLM.
    dtype = getattr(layer, "params_dtype", weight.dtype)
    probe = torch.empty((1, weight.shape[1]), dtype=dtype, device="meta")
    try:
        producers.get(producer).check(probe, weight, weight_scale)
    except (TypeError, ValueError) as e:
        return str(e)
    return Route(producer, operands, weight.shape[0], why)


def _generic(layer: Any, why: str) -> Route | str:
    """A route through the layer's own apply, if the layer says its (N, K) and device."""
    if not callable(getattr(layer.quant_method, "apply", None)):
        return f"its quant method {type(layer.quant_method).__name__} has no apply"
    n = getattr(layer, "output_size_per_partition", None)
    k = getattr(layer, "input_size_per_partition", None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, k)):
        return ("its own apply needs the layer's output_size_per_partition and "
                f"input_size_per_partition (N, K) as positive integers, got ({n!r}, {k!r})")
    if device_of(layer) is None:
        return "the layer has no parameter or buffer to place the op's operands with"
    return Route(GENERIC, shape_carrier_operands, n, why)


def device_of(layer: Any) -> torch.device | None:
    """The device of the layer's first parameter or buffer (None without one)."""
    tensors = itertools.chain(layer.parameters(), layer.buffers()) \
        if isinstance(layer, torch.nn.Module) else iter(())
    first = next(tensors, None)
    return None if first is None else first.device
