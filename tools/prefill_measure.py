"""Verify and time the prefill stack's arms (tools/prefill_bench.py; emulated world: prefill_emulated.py).

Arms: ``off`` runs each RowParallel linear as the GEMM then the world's unsliced
all-reduce (process worlds: ``stock``, the vendor collective; the emulated world, which
has none: the same backend at one slice, as compare_backends' serial baseline); ``on``
runs it through the op's sliced pipeline with a backend.

Correctness, checked before anything is timed (a wrong arm is not timed):

- per call, in the same run: every RowParallel call's output against the float64 sum
  over ranks of that call's partial products (the producer's output, as the op's GEMM
  makes it), within the backend's ``rel_rms_bound``; that is the backend's contract.
- the stack: the final hidden states the same bits on every rank, finite, and the on
  arm within ``stack_bound`` of the off arm. Errors of the 2L all-reduces of a layer
  stack compound: with the wht6 codec each call is within 2^-5 but the output of a
  stack differs from the exact-sum one by 1.7% (1 layer), 2.5% (2), 3.4% (4), 4.2% (8),
  growing as sqrt(L) (CPU reference codec, random weights, hidden 512, W = 2; 3.2-4.7%
  at hidden 256-1024, W = 2-4, 4-8 layers). The stack is therefore held to
  ``rel_rms_bound * sqrt(2L)`` (per-call errors adding in quadrature). With an fp8
  producer small differences flip activation codes: the same stacks differ by 3.3%,
  5.5%, 7.9%, 10% at 1, 2, 4, 8 layers, held to ``sqrt(rel_rms_bound * 2^-3) * sqrt(2L)``
  (:meth:`Spec.stack_bound`). The per-call check is the backend's contract; the stack
  check catches what happens between calls (an output overwritten after the call).

Timing (GPU only; CPU worlds check correctness and report no time): one repeat is the
whole prefill, every chunk through every layer, with a device event after every
component (:data:`prefill_stack.COMPONENTS`); medians over ``reps`` after ``warmup``.
For the off arm also the all-reduce alone and the two RowParallel GEMMs alone at every
chunk size, which give the all-reduce's share of the prefill and the ceiling: the
off arm's time less, per RowParallel call, min(its GEMM, its all-reduce). For an on arm
also its pipeline's bound (the prefill at efficiency 1 with the slices it cut:
:func:`add_bound`), from the same GEMMs and its backend's all-reduce alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from radiance_ar import backends
import gpu_timing
import metrics
from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.streams import current_stream_handle
from radiance_ar.transport.world import World
from model_shapes import RankShapes
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
from radiance_ar.overlap.plan import input_view, row_bounds
from radiance_ar.overlap.slicing import slice_count
from prefill_stack import (COMPONENTS, DTYPE, ShardModel, activation_step, make_chunks,
                           prefill_steps, run_alone)
from world_measure import digest


@dataclass(frozen=True)
class Spec:
    shapes: RankShapes
    layers: int
    chunk_rows: tuple[int, ...]
    producer: str = "bf16"
    #: S of the on arms: an int, or ``auto`` (each backend's preferred S for the world size
    #: and each chunk's rows, as the op chooses it)
    slices: int | str = "auto"
    backends: tuple[str, ...] = ()
    reps: int = 20
    warmup: int = 3
    seed: int = 0
    gqa: str = "enable_gqa"
    #: return each arm's stack output on rank 0's record (tests)
    keep_outputs: bool = False
    knobs: BackendSettings = field(default_factory=BackendSettings)

    @property
    def tokens(self) -> int:
        return sum(self.chunk_rows)

    @property
    def ar_calls(self) -> int:
        return 2 * self.layers * len(self.chunk_rows)

    def stack_bound(self, call_bound: float) -> float:
        """How far the on arm's stack output may lie from the off arm's: per all-reduce
        ``call_bound``, or sqrt(call_bound x step) where the producer quantizes its
        activations (prefill_stack.ACTIVATION_STEP), adding in quadrature over the 2L
        all-reduces of a token's path."""
        step = activation_step(self.producer)
        per_call = call_bound if step is None else max(call_bound, math.sqrt(call_bound * step))
        return per_call * math.sqrt(2 * self.layers)

    def model(self, rank: int, device: torch.device) -> ShardModel:
        m = ShardModel(self.shapes, self.layers, rank, device, self.producer, self.seed, self.gqa)
        for rows in set(self.chunk_rows):
            m.rope(rows)
        return m

    def chunks(self, device: torch.device) -> list[torch.Tensor]:
        return make_chunks(self.shapes.hidden, list(self.chunk_rows), device, self.seed)


def chunk_rows(tokens: int, chunk: int) -> tuple[int, ...]:
    """The rows of each forward: full chunks, then the remainder (vLLM's chunked prefill)."""
    if tokens < 1 or chunk < 1:
        raise ValueError(f"tokens ({tokens}) and chunk ({chunk}) must be >= 1")
    return (chunk,) * (tokens // chunk) + ((tokens % chunk,) if tokens % chunk else ())


def worst(values: list[float]) -> float:
    """The largest value, NaN if any is NaN (``max`` would drop it)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def gate_reason(name: str, world: World, cols: int) -> str | None:
    """Why backend ``name`` has no on arm in ``world`` for rows of ``cols`` (None: it has)."""
    cls = backends.get(name)
    reason = cls.unsupported_reason(world)
    if reason is None and not cls.pipelined:
        reason = "not pipelined (GEMM then one unsliced all-reduce): it is the off arm here"
    return reason if reason is not None else cls.unsupported_cols_reason(cols)


def chunk_slices(spec: Spec, backend: str, rows: int) -> int:
    """The S ``backend``'s on arm cuts a chunk of ``rows`` rows into: ``spec.slices``, or
    for ``auto`` what the op runs at this TP degree (``Backend.preferred_slices_for``)."""
    return slice_count(spec.slices, backends.get(backend), rows, settings(spec, backend).plan,
                       spec.shapes.tp)


def chunk_bounds(spec: Spec, producer, backend: str, rows: int) -> list[int]:
    """The row bounds ``backend``'s on arm cuts a chunk of ``rows`` rows into: its S
    (:func:`chunk_slices`) and plan at ``producer``'s row alignment, through the op's own
    bounds (``plan.row_bounds``)."""
    return row_bounds(producer, rows, chunk_slices(spec, backend, rows),
                      settings(spec, backend).plan)


def arm_slices(spec: Spec, backend: str) -> int | str:
    """The S of ``backend``'s on arm as recorded: one count, or the chunks' distinct
    counts in order joined by ``/`` where they differ (``auto`` chooses per chunk)."""
    counts = dict.fromkeys(chunk_slices(spec, backend, rows) for rows in spec.chunk_rows)
    return next(iter(counts)) if len(counts) == 1 else "/".join(map(str, counts))


def settings(spec: Spec, backend: str, slices: int | None = None) -> OverlapSettings:
    """The runtime settings of ``backend``'s arm (S: ``slices``, default its on arm's:
    ``spec.slices``, where ``auto`` lets the op choose per chunk as it does in serving).
    min_m = 1: every chunk takes the sliced path (the emulated world has no vendor
    collective for the decode path, and every prefill chunk here is a full forward)."""
    return OverlapSettings(True, backend, 1, spec.slices if slices is None else slices, spec.knobs)


def op_of(rt: overlap.OverlapRuntime, producer: str):
    return lambda x, w: forward(rt, x, w.weight, w.scale, producer)


def verdict(spec: Spec, bound: float, call_rels: list[float], identical: bool, finite: bool,
            stack_rel: float | None) -> dict:
    call_rel = worst(call_rels)
    rec = {"call_rel_rms_max": call_rel, "call_bound": bound, "identical_on_ranks": identical,
           "finite": finite, "stack_rel_rms_vs_off": stack_rel,
           "stack_bound": spec.stack_bound(bound)}
    rec["correct"] = bool(call_rel <= bound and identical and finite
                          and (stack_rel is None or stack_rel <= rec["stack_bound"]))
    return rec


# ----------------------------------------------------------------------- timing (GPU)

def time_prefill(model: ShardModel, chunks: list[torch.Tensor], row_parallel, reps: int,
                 warmup: int, before=None) -> dict:
    """Median device time of the whole prefill and of each component (summed over layers
    and chunks), from an event after every component; spreads are half the IQR. Each is a
    median of its own, so the components add up to the whole only where the repeats agree:
    with ``warmup`` < 2 the first repeat holds the op's graph captures (a shape's second
    call), 3-4x the others (tools/results/2026-12-05-h100-prefill-bound-and-call-streams/
    prefill_diag.log), and with 3 repeats the emulated GPU test's parts missed 30% of it."""
    def run(mark):
        run_alone(prefill_steps(model, chunks, row_parallel), mark)

    for _ in range(warmup):
        run(None)
    torch.cuda.synchronize()
    totals, parts = [], {c: [] for c in COMPONENTS}
    for _ in range(reps):
        if before is not None:
            before()
        marks = []

        def mark(name, marks=marks):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((name, ev))

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(mark)
        end.record()
        end.synchronize()
        totals.append(start.elapsed_time(end))
        sums, prev = dict.fromkeys(COMPONENTS, 0.0), start
        for name, ev in marks:
            sums[name] += prev.elapsed_time(ev)
            prev = ev
        for c in COMPONENTS:
            parts[c].append(sums[c])
    rec = {"reps": reps}
    rec["t_prefill_ms"], rec["t_prefill_spread_ms"] = metrics.median_and_spread(totals)
    for c in COMPONENTS:
        rec[f"t_{c}_ms"], rec[f"t_{c}_spread_ms"] = metrics.median_and_spread(parts[c])
    return rec


def off_arm_parts(spec: Spec, model: ShardModel, backend, before=None) -> dict:
    """The off arm's all-reduce alone and its RowParallel GEMMs alone, per chunk size,
    and what they make of the prefill: the all-reduce's share and the ceiling."""
    hidden, device = spec.shapes.hidden, model.device
    per_rows = {}
    for rows, ar in ar_alone_ms(spec, backend, device, before).items():
        t = {"ar": ar}
        for name, w in (("o_proj", model.layers[0].o_proj), ("down_proj", model.layers[0].down_proj)):
            x = torch.randn(rows, model.inner(w), dtype=DTYPE, device=device)
            prepared = model.producer.prepare(x, w.weight, w.scale, model.scratch)
            y = torch.empty(rows, hidden, dtype=DTYPE, device=device)
            t[name] = gpu_timing.device_and_host_ms(
                lambda i: model.producer.launch(prepared, 0, rows, y, current_stream_handle(device)),
                spec.reps, spec.warmup, before)[0]
        per_rows[rows] = t
    n_chunks = {rows: spec.chunk_rows.count(rows) for rows in per_rows}
    ar_ms = sum(2 * spec.layers * n * per_rows[r]["ar"] for r, n in n_chunks.items())
    hideable = sum(spec.layers * n * (min(per_rows[r]["o_proj"], per_rows[r]["ar"])
                                      + min(per_rows[r]["down_proj"], per_rows[r]["ar"]))
                   for r, n in n_chunks.items())
    return {"t_ar_total_ms": ar_ms, "t_hideable_ms": hideable,
            "per_chunk_rows": {str(r): {f"t_{k}_ms": v for k, v in t.items()}
                               for r, t in per_rows.items()}}


def ar_alone_ms(spec: Spec, backend, device: torch.device, before=None) -> dict[int, float]:
    """Collective: ``backend``'s unsliced all-reduce alone at every chunk size (rows ->
    median ms)."""
    hidden, times = spec.shapes.hidden, {}
    for rows in sorted(set(spec.chunk_rows)):
        # torch.randn is torch.empty then normal_: the same values either way
        ar_in = input_view(backend, rows, hidden, DTYPE,
                           lambda: torch.empty(rows, hidden, dtype=DTYPE, device=device))
        ar_in.normal_()
        ar_out = torch.empty(rows, hidden, dtype=DTYPE, device=device)
        times[rows] = gpu_timing.device_and_host_ms(lambda i: backend.all_reduce(ar_in, ar_out),
                                                    spec.reps, spec.warmup, before)[0]
    return times


def add_bound(spec: Spec, model: ShardModel, rec: dict, off: dict,
              ar_on: dict[int, float] | None = None) -> None:
    """An on arm's ``bound_ms`` (the prefill at efficiency 1: the off arm less what each
    RowParallel call's pipeline could hide with the slices this arm cuts each chunk into,
    :func:`metrics.stack_bound_ms`), ``speedup_bound`` (off / bound: the most those slices
    can give) and ``efficiency`` (bound / this arm), from the off arm's GEMMs and
    all-reduce alone per chunk size. ``ar_on``: the on arm's backend's unsliced all-reduce
    per chunk size (:func:`ar_alone_ms`); default the off arm's, the same backend in the
    emulated world."""
    calls = []
    for rows in spec.chunk_rows:
        t = off["per_chunk_rows"][str(rows)]
        bounds = chunk_bounds(spec, model.producer, rec["backend"], rows)
        ar = t["t_ar_ms"] if ar_on is None else ar_on[rows]
        calls += [(spec.layers, t[f"t_{lin}_ms"], t["t_ar_ms"], ar, bounds)
                  for lin in ("o_proj", "down_proj")]
    rec["bound_ms"] = metrics.stack_bound_ms(off["t_prefill_ms"], calls)
    rec["speedup_bound"] = metrics.speedup_bound(off["t_prefill_ms"], rec["bound_ms"])
    rec["efficiency"] = metrics.efficiency(rec["bound_ms"], rec["t_prefill_ms"])


def add_figures(spec: Spec, rec: dict, off: dict | None) -> None:
    """tokens/s; for the off arm the AR share and ceiling, for an on arm the speedup."""
    rec["tokens_per_s"] = spec.tokens / (rec["t_prefill_ms"] * 1e-3)
    if rec["arm"] == "off":
        rec["ar_share"] = rec["t_ar_total_ms"] / rec["t_prefill_ms"]
        rec["ceiling_speedup"] = rec["t_prefill_ms"] / (rec["t_prefill_ms"] - rec["t_hideable_ms"])
    elif off is not None and off.get("t_prefill_ms") is not None:
        rec["speedup"] = off["t_prefill_ms"] / rec["t_prefill_ms"]


# ----------------------------------------------------------------------- process worlds

def _verify_process(world: World, spec: Spec, model: ShardModel, chunks, rt,
                    reference: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """Collective: run the prefill once with every call checked (see module doc)."""
    op, rels = op_of(rt, spec.producer), []

    def checked(x, w):
        out = op(x, w)
        exact = model.gemm(x, w).double()
        dist.all_reduce(exact, group=world.group)
        rels.append(metrics.errors(out, exact)[0])
        return out

    out = torch.cat(run_alone(prefill_steps(model, chunks, checked)))
    stack_rel = None if reference is None else metrics.errors(out, reference.double())[0]
    mine = (digest(out), worst(rels), stack_rel, bool(torch.isfinite(out).all()))
    every = [None] * world.size
    dist.all_gather_object(every, mine, group=world.group)
    rec = verdict(spec, rt.backend.rel_rms_bound, [e[1] for e in every],
                  len({e[0] for e in every}) == 1, all(e[3] for e in every),
                  None if reference is None else worst([e[2] for e in every]))
    return rec, out


def process_world_job(world: World, spec: Spec, timed: bool = True) -> list[dict]:
    """Collective, on every rank of a CPU or torchrun world: the off arm (stock), then an
    on arm per backend of ``spec.backends`` that serves the world. Timed on GPUs only, and
    only where ``timed`` (ranks sharing one GPU time-slice each other's kernels)."""
    gpu = world.device.type == "cuda" and timed
    before = world.memory.barrier
    model, chunks = spec.model(world.rank, world.device), spec.chunks(world.device)
    base = {"world": world.kind, "W": world.size, "tokens": spec.tokens,
            "chunks": len(spec.chunk_rows), "layers": spec.layers, "producer": spec.producer}
    off_rt = overlap.build(world, settings(spec, "stock", 1))
    try:
        off, off_out = _verify_process(world, spec, model, chunks, off_rt, None)
        off = dict(base, arm="off", backend="stock", slices=1, **off)
        if spec.keep_outputs:
            off["output"] = off_out
        if gpu and off["correct"]:
            off.update(time_prefill(model, chunks, op_of(off_rt, spec.producer), spec.reps,
                                    spec.warmup, before))
            off.update(off_arm_parts(spec, model, off_rt.backend, before))
            add_figures(spec, off, None)
    finally:
        off_rt.close()
    records = [off]
    # stock (not pipelined) is the off arm of a process world, not an on arm
    for name in [b for b in spec.backends if backends.get(b).pipelined]:
        reason = gate_reason(name, world, spec.shapes.hidden)
        if reason is not None:
            records.append(dict(base, arm="on", backend=name, skipped=reason, correct=None))
            continue
        rt = overlap.build(world, settings(spec, name))
        try:
            rec, out = _verify_process(world, spec, model, chunks, rt, off_out)
            rec = dict(base, arm="on", backend=name, slices=arm_slices(spec, name), **rec)
            if spec.keep_outputs:
                rec["output"] = out
            if gpu and rec["correct"]:
                rec.update(time_prefill(model, chunks, op_of(rt, spec.producer), spec.reps,
                                        spec.warmup, before))
                add_figures(spec, rec, off)
                if off.get("per_chunk_rows") is not None:
                    add_bound(spec, model, rec, off,
                              ar_alone_ms(spec, rt.backend, world.device, before))
        finally:
            rt.close()
        records.append(rec)
    return records
