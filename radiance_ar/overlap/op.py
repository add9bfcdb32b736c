"""``radiance::linear_ar``: a RowParallel linear and its all-reduce as ONE opaque op.

Plain-torch meaning, for x and weight the rank's shards::

    out = sum over ranks r of (x_r @ weight_r.T)          # M x N, dtype of x

torch.compile sees one node (a fake is registered), so the M-dependent branch, the
streams and the events below are runtime-internal: a shape branch written in Python
around the op would split the compiled graph at every linear (the deployment this
project comes from measured ~30% of decode lost to such graph breaks). Inside:

- M < RADIANCE_AR_OVERLAP_MIN_M, or backend ``stock``: GEMM, then the vendor
  all-reduce in place. No stream or event API: this arm runs inside decode's captured
  CUDA graphs.
- otherwise: the sliced pipeline of :mod:`radiance_ar.overlap.pipeline` with the chosen
  backend; where the runtime replays (``RADIANCE_AR_OP_GRAPHS``), the first call of a
  shape runs it step by step, the second captures it, later ones replay it with one
  launch (:mod:`radiance_ar.overlap.graphs`).

Both arms are planned and run by :class:`radiance_ar.overlap.plan.CallPlan`, which the
timeline and the measurement tools use too, so they measure the op's own calls.

The op is collective and ordered: every rank makes the same calls in the same order.
The backends check that on every call (:mod:`radiance_ar.call_contract`) and raise on
every rank that sees a late, missing or mismatched peer; one runtime serves one call
at a time, from the thread of its first call (any other thread is refused, and the
refusal faults the rank). Inside a caller's
CUDA-graph capture the sliced path runs where the backend's ``caller_capture_reason`` is
None (``capture_safe`` backends; sdma and sdma_wht6 with the watchdog:
:mod:`radiance_ar.transport.caller_graphs`), and raises with that reason elsewhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from radiance_ar.call_contract import CallSignature, CollectiveError
from radiance_ar.overlap import producers
from radiance_ar.overlap.plan import CallPlan, in_caller_capture
from radiance_ar.streams import capturing
from radiance_ar.overlap.producers import Producer
from radiance_ar.overlap.runtime import OverlapRuntime, current

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
    weight_k = weight.shape[1] * prod.values_per_weight_element
    if x.shape[1] != weight_k:
        raise ValueError(f"radiance::linear_ar: K mismatch: x has {x.shape[1]} columns, "
                         f"weight (N, K) has K = {weight_k}")
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
    with rt.one_call_at_a_time():
        call_rt = rt.for_call(x.shape[0], weight.shape[0], prod.name)
        try:
            return _forward(call_rt, prod, x, weight, weight_scale)
        except CollectiveError as e:
            _release_peer_in_vendor_call(call_rt, rt, e)
            raise


def _forward(rt: OverlapRuntime, prod: Producer, x: torch.Tensor, weight: torch.Tensor,
             weight_scale: Optional[torch.Tensor]) -> torch.Tensor:
    if not CallPlan.slices_rows(rt, x.shape[0]):
        plan = CallPlan.for_call(rt, prod, x, weight)
        out = torch.empty((plan.rows, plan.cols), dtype=x.dtype, device=x.device)
        plan.run(rt, prod, x, weight, weight_scale, out)
        if capturing(x.device):  # a caller's graph replays the scratch it used (a producer's
            rt.scratch.held = True  # quantized activation): a growth keeps, never frees, it
        return out
    in_capture = in_caller_capture(rt, x)  # raises where the backend may not run there
    # everything a sliced call's plan, graph and signature depend on (the layer's number
    # included: it may be registered after a first call)
    operands = (x.shape[0], x.shape[1], x.dtype, weight.data_ptr(), weight.shape[0],
                None if weight_scale is None else weight_scale.data_ptr(), prod.name,
                rt.layer_number(weight))
    known = rt.sliced_calls.get(operands)
    if known is None:
        known = rt.remember_sliced_call(operands, _SlicedCall.of(
            CallPlan.for_call(rt, prod, x, weight), rt.backend, x.dtype))
    plan, backend = known.plan, rt.backend

    def body(x_in: torch.Tensor, out: torch.Tensor) -> None:
        """The sliced path: prepare, then GEMM slices pipelined with their ARs (the call
        key set here: a remembered plan skips ``for_call``, which sets it too)."""
        plan.set_call_key(backend)
        plan.run(rt, prod, x_in, weight, weight_scale, out)

    graphs = None if in_capture else rt.graphs()
    if graphs is None:
        out = torch.empty((plan.rows, plan.cols), dtype=x.dtype, device=x.device)
        # in a caller's graph the call is one captured round
        with rt.caller_capture_round(known.sig) if in_capture else contextlib.nullcontext():
            body(x, out)
        return out
    return graphs.call(operands, weight.data_ptr(),
                       lambda: (rt.scratch.growths, backend.generation), x,
                       (plan.rows, plan.cols), known.sig, backend, body)


@dataclass(frozen=True)
class _SlicedCall:
    """What a sliced call of given operands needs besides them, built at its first call:
    its plan and its signature (the header of each replay); its operands key its graph.
    A replayed call builds neither again: on an H200 host the plan took 8.4 us and the
    signature 2.5 of a replayed call's 185 (W = 2, sdma_wht6, S = 4;
    tools/results/2026-12-04-h200-replay-node-costs/host_pieces.json)."""
    plan: CallPlan
    sig: CallSignature

    @classmethod
    def of(cls, plan: CallPlan, backend, dtype: torch.dtype) -> "_SlicedCall":
        return cls(plan, CallSignature(plan.rows, plan.cols, dtype, "flags", plan.rows, plan.k,
                                       plan.layer, backend.tuning_word))


def _release_peer_in_vendor_call(call_rt: OverlapRuntime, rt: OverlapRuntime,
                                 error: BaseException) -> None:
    """A peer took the decode path (vendor all-reduce) for a call this rank sliced: join
    its collective once with NaN so it is not left blocked until the vendor's timeout.
    It then reads this rank's abort word and raises too (``Backend.vendor_call``). The
    decode path announces on ``rt``'s flags: under auto the parent's, not those of the
    child ``call_rt`` that failed, so there the abort word is set first."""
    for r in (call_rt,) if call_rt is rt else (call_rt, rt):
        signals = r.backend.signals
        sig = signals.missed_vendor_call() if signals is not None else None
        if sig is None or r.stock_reason() is not None:
            continue
        if r is not call_rt:
            r.backend.fault(error)
        nan = torch.full((sig.rows, sig.cols), float("nan"), dtype=sig.dtype,
                         device=r.world.device)
        r.stock.all_reduce(nan, nan)
        signals.joined_vendor_call()
        return


@torch.library.custom_op("radiance::linear_ar", mutates_args=())
def linear_ar(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
              producer: str) -> torch.Tensor:
    """``sum over ranks of x @ weight.T`` through this process's runtime (see module doc)."""
    return forward(current(), x, weight, weight_scale, producer)


@linear_ar.register_fake
def _linear_ar_fake(x, weight, weight_scale, producer):
    check_inputs(x, weight, weight_scale, producer)
    return x.new_empty((x.shape[0], weight.shape[0]))
