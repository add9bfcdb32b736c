"""The generic producer: a layer's own quantized linear method, one row slice at a time.

Any linear method whose ``apply(layer, x)`` returns ``x @ W.T`` (W possibly quantized:
weight-only, fp8, int8, ...) becomes a producer: ``launch`` runs
``layer.quant_method.apply(layer, x[a:b])`` and copies the result into the slice view.
The op passes tensors only, so the layer is reached through the producer's name:
:func:`bind_layer` builds one :class:`QuantMethodProducer` per layer and binds it (in
:mod:`radiance_ar.overlap.producers`) as ``quant_method:<key>``, ``key`` being the layer's name in
its model. That name is the string constant a traced graph holds, so it must be the
same in every process and run (an ``id()`` would break a graph cached on disk); a
second live layer under the same key (a second model in the process) gets ``#2``, ...

The op's ``weight`` argument is then a shape carrier, :func:`shape_carrier`: an (N, K)
tensor of one element broadcast with zero strides, never read. It carries what the op's
checks and fake (torch.compile) need -- N, K and the device -- without a copy of the
weights; the layer's real tensors are read by its method at every call.

**Exactness.** Sliced equals unsliced, bit for bit, where the method's activation
quantization is row-independent (per-token dynamic scales, static scales, weight-only)
and its GEMM computes each row independently of M. A method with per-tensor DYNAMIC
activation scales must not be routed here: each slice would get its own scale (vLLM's
fp8 per-tensor scheme goes to the ``fp8_tensorwise`` producer instead, which takes one
scale over the whole input; see :mod:`radiance_ar.overlap.vllm_routes`).

**Streams and memory, with no cross-stream lifetime bookkeeping.** ``apply`` has no
output argument, so it allocates its result (and any internal temporaries) per slice:
the pipeline runs ``launch`` in the side stream's context, so the caching allocator
takes those blocks from the side stream's pool and, when they are dropped at the end of
``launch``, returns them to that pool. Every use of them -- ``apply``'s kernels and the
copy into the slice view -- is on the side stream itself, so a later allocation that
reuses a block is ordered after those uses by the stream, and no cross-stream use exists
to fence. Nothing is allocated on the all-reduce's (caller's) stream. What crosses
streams is what :mod:`radiance_ar.overlap.pipeline` already orders: ``x`` (the caller's, read on the
side stream; the caller's stream waits for the side stream before the op returns) and
the persistent slice views. The cost: the side stream's pool holds one slice's
temporaries (its output, (M/S) x N, and what ``apply`` quantizes) after the first sliced
call at the largest M; it is reused, not grown, by later calls (tested over random M).
The copy is an extra write and read of the slice's output, which a method with an
``out=`` argument could avoid.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from radiance_ar.overlap import producers
from radiance_ar.overlap.producers import Producer

#: the producer name a user maps a quant method to; bound producers are named
#: ``quant_method:<layer key>``
GENERIC = producers.RESERVED
PREFIX = GENERIC + ":"


def shape_carrier(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """An (rows, cols) tensor of ONE uint8 element with zero strides: the op's ``weight``
    argument for a bound producer (its shape and device are read, its value never)."""
    return torch.zeros((), dtype=torch.uint8, device=device).expand(rows, cols)


class QuantMethodProducer(Producer):
    """``layer.quant_method.apply(layer, x[a:b])`` into the slice view (module docstring)."""

    def __init__(self, name: str, layer: torch.nn.Module, out_features: int, in_features: int):
        self.name = name
        # A weak reference: the producer table must not keep an unloaded model alive.
        self._layer = weakref.ref(layer)
        self.out_features, self.in_features = out_features, in_features

    def layer(self) -> torch.nn.Module | None:
        """The bound layer, or None once it has been garbage-collected."""
        return self._layer()

    def _live_layer(self) -> torch.nn.Module:
        layer = self._layer()
        if layer is None:
            raise RuntimeError(f"producer {self.name!r}: its layer has been garbage-collected "
                               "(the model was unloaded); route the new model's layers again")
        return layer

    def check(self, x, weight, weight_scale):
        self._live_layer()
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"producer {self.name!r}: weight must be the layer's (N, K) = "
                             f"{expected} shape carrier, got shape {tuple(weight.shape)}")
        if weight_scale is not None:
            raise ValueError(f"producer {self.name!r}: weight_scale must be None (the "
                             "layer's quant method reads its own scales)")

    def launch(self, p, a, b, out, stream):
        layer = self._live_layer()
        y = layer.quant_method.apply(layer, p.x[a:b])
        if tuple(y.shape) != tuple(out.shape):
            raise ValueError(f"producer {self.name!r}: {type(layer.quant_method).__name__}."
                             f"apply returned shape {tuple(y.shape)} for {b - a} rows, "
                             f"expected {tuple(out.shape)}")
        if y.dtype != out.dtype:
            raise TypeError(f"producer {self.name!r}: {type(layer.quant_method).__name__}."
                            f"apply returned {y.dtype}; the op returns the activation's "
                            f"dtype {out.dtype} (build the layer under the model's dtype)")
        out.copy_(y)


def bind_layer(key: str, layer: Any, out_features: int, in_features: int) -> str:
    """Bind ``layer``'s own quant method as a producer; returns the name to pass to the op.

    Idempotent for the same layer. A name whose layer is gone is taken over; one whose
    layer is alive and another gets the next free ``#n`` suffix."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"bind_layer: key must be a non-empty string (the layer's name in "
                         f"its model), got {key!r}")
    base, n = PREFIX + key, 1
    name = base
    while True:
        existing = producers.bound(name)
        if not isinstance(existing, QuantMethodProducer) or existing.layer() is None:
            break
        if existing.layer() is layer:
            return name
        n += 1
        name = f"{base}#{n}"
    producers.bind(QuantMethodProducer(name, layer, out_features, in_features))
    return name
