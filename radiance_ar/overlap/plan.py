"""One op call, planned once and run by everyone: the op, the timeline and the tools.

Plain-torch meaning of a planned call, for the rank's shards ``x`` and ``weight``::

    out = sum over ranks r of (x_r @ weight_r.T)          # M x N, dtype of x

:class:`CallPlan` holds what ``radiance::linear_ar`` decides before it computes: the path
(sliced pipeline, or GEMM then the vendor all-reduce), the row bounds of the slices
(:func:`radiance_ar.overlap.slicing.op_bounds`: the settings' slice count and plan at the
producer's row alignment), and the call's identity at the backend (``Backend.set_call_key``:
M, K and the layer's number, which every slice's signature carries). :meth:`CallPlan.run`
then runs the call exactly as the op does, with optional :class:`SliceHooks` around each
GEMM slice and each AR slice: a tool that records events or times through the hooks
measures the op's own calls, not a copy of them.

:func:`input_view` is the one place of the step "the peer-visible view, else a buffer
of one's own": the tensor the op's GEMM writes and its ARs read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from radiance_ar.backends.interface import Backend
from radiance_ar.envs import OVERLAP_PLANS
from radiance_ar.overlap.pipeline import SliceHooks, run_sliced
from radiance_ar.overlap.producers import Producer
from radiance_ar.overlap.slicing import op_bounds, slice_bounds, slice_count
from radiance_ar.streams import capturing, current_stream_handle

__all__ = ["CallPlan", "SliceHooks", "input_view", "row_bounds"]

#: hooks that do nothing (the op's own calls)
NO_HOOKS = SliceHooks()


def row_bounds(prod: Producer, rows: int, slices: int | str, plan: str = OVERLAP_PLANS[0],
               backend: Any = None) -> list[int]:
    """The row bounds the op cuts ``rows`` rows into for producer ``prod``: ``slices``
    slices (``"auto"``: ``backend``'s ``preferred_slices_for``, ``backend`` an instance)
    cut by ``plan``, interior bounds multiples of ``prod.slice_row_align`` (as
    :func:`slicing.op_bounds`)."""
    return slice_bounds(rows, slice_count(slices, backend, rows, plan), prod.slice_row_align, plan)


def input_view(backend: Backend, rows: int, cols: int, dtype: torch.dtype,
               otherwise: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """The ``rows x cols`` tensor the op's GEMM writes and its all-reduce reads, as the
    op gets it: the backend grown to hold ``rows x cols`` (``ensure_capacity``:
    collective, a no-op once grown), then its peer-visible input view
    (``acquire_input_view``, which enqueues the fence against the peers' reads of the
    previous call) where ``backend.peer_visible_input``, else ``otherwise()`` (the op:
    its scratch buffer; a tool: a tensor of its own). Without ``otherwise`` the backend
    must have a peer-visible input."""
    backend.ensure_capacity(rows, cols, dtype)
    if backend.peer_visible_input or otherwise is None:
        return backend.acquire_input_view(rows, cols, dtype)
    return otherwise()


def in_caller_capture(rt: Any, x: torch.Tensor) -> bool:
    """Whether ``x``'s stream is capturing a caller's CUDA graph, for a sliced call; raises
    ``RuntimeError`` with the reason where the runtime's backend may not run there
    (:meth:`OverlapRuntime.caller_capture_reason`)."""
    if not capturing(x.device):
        return False
    reason = rt.caller_capture_reason()
    if reason is not None:
        raise RuntimeError(
            f"radiance::linear_ar: backend {rt.backend.name!r} cannot run its sliced path "
            f"(M = {x.shape[0]} >= RADIANCE_AR_OVERLAP_MIN_M = {rt.settings.min_m}) inside "
            f"CUDA-graph capture: {reason}; capture only the decode path (M below MIN_M) or "
            "choose a capture-safe backend")
    return True


@dataclass(frozen=True)
class CallPlan:
    """One op call's decisions (see the module doc); build with :meth:`for_call`."""

    rows: int  # M
    cols: int  # N
    k: int  # K
    #: the layer's registered number (``OverlapRuntime.register_layer``; 0: none), 0 unsliced
    layer: int
    #: ``(0, b1, ..., M)``; slice s is rows ``bounds[s]:bounds[s+1]``; ``(0, M)`` unsliced
    bounds: tuple[int, ...]
    #: True: the sliced pipeline with the runtime's backend; False: GEMM then the vendor
    #: all-reduce (M below RADIANCE_AR_OVERLAP_MIN_M, or a backend that is not pipelined)
    sliced: bool

    @property
    def slices(self) -> int:
        return len(self.bounds) - 1

    @classmethod
    def for_call(cls, rt: Any, prod: Producer, x: torch.Tensor,
                 weight: torch.Tensor) -> "CallPlan":
        """Plan a call of ``x`` (M x K) against ``weight`` (N rows) on runtime ``rt``.

        Where it slices, this sets the backend's call key (M, K, the layer) for the
        slices that follow. The op asks whether a sliced call is inside a caller's
        capture before it plans (:func:`in_caller_capture`, once per call)."""
        rows, cols, k = x.shape[0], weight.shape[0], x.shape[1]
        backend = rt.backend
        if not cls.slices_rows(rt, rows):
            return cls(rows, cols, k, 0, (0, rows), False)
        layer = rt.layer_number(weight)
        plan = cls(rows, cols, k, layer,
                   tuple(op_bounds(rt.settings, backend, rows, prod.slice_row_align)), True)
        plan.set_call_key(backend)
        return plan

    @staticmethod
    def slices_rows(rt: Any, rows: int) -> bool:
        """Whether a call of ``rows`` rows takes the sliced pipeline on runtime ``rt``."""
        return rows >= rt.settings.min_m and rt.backend.pipelined

    def set_call_key(self, backend: Backend) -> None:
        """Tell ``backend`` the call its slices belong to (M, K, the layer)."""
        backend.set_call_key(self.rows, self.k, self.layer)

    def input_view(self, rt: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The sliced call's GEMM output, the backend grown to M x N first: its
        peer-visible view, else the runtime's scratch buffer ``gemm_out``
        (:func:`input_view`)."""
        return input_view(rt.backend, self.rows, self.cols, dtype,
                          lambda: rt.scratch.get("gemm_out", (self.rows, self.cols), dtype, device))

    def run(self, rt: Any, prod: Producer, x: torch.Tensor, weight: torch.Tensor,
            weight_scale: torch.Tensor | None, out: torch.Tensor,
            hooks: SliceHooks | None = None) -> None:
        """``out[...] = sum over ranks of x @ weight.T`` as the op computes it: the
        producer prepares ``x``; sliced, the backend grows to M x N, the GEMM slices
        write :meth:`input_view` and their all-reduces fill ``out``
        (:func:`pipeline.run_sliced`); unsliced, one GEMM into ``out`` on the current
        stream, then the vendor all-reduce in place. ``hooks``: around each GEMM and AR
        slice (unsliced: one of each, slice 0, on the current stream)."""
        prepared = prod.prepare(x, weight, weight_scale, rt.scratch)
        if self.sliced:
            y = self.input_view(rt, out.dtype, x.device)
            run_sliced(prepared, prod, rt.backend, y, out, self.bounds, rt.lanes(), hooks)
            return
        hooks = hooks if hooks is not None else NO_HOOKS
        hooks.gemm_before(0)
        prod.launch(prepared, 0, self.rows, out, current_stream_handle(x.device))
        hooks.gemm_after(0)
        hooks.ar_before(0)
        with rt.backend.vendor_call(out):
            rt.stock.all_reduce(out, out)
        hooks.ar_after(0)
