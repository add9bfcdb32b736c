"""One (backend, M, slices) measurement on every rank of a process world.

Runs the same code on each rank of a CPU world (gloo) or of a torchrun GPU world:
verify first, then time. Timings are medians over ``reps`` after ``warmup`` calls; on a GPU
device-event samples (:func:`gpu_timing.event_times`: an untimed barrier before each sample of
back-to-back calls), on the CPU ``perf_counter`` times of calls each after a barrier. The
reference is independent of every backend: each rank's float64 product of its dequantized
operands (:mod:`producer_inputs`), summed over ranks by a float64 all-reduce.

Besides GEMM, AR, serial and overlapped op, it times the AR as S slice calls back to
back (the slice overhead); on a GPU also the GEMM beside the AR (contention), the raw
link between the ranks (:mod:`link`) and, with ``Case.timeline``, one op call's events
(:mod:`timeline`). The derived figures are :func:`metrics.derived`'s.
"""

from __future__ import annotations

import functools
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import gpu_timing
import link
import metrics
from radiance_ar import overlap
import producer_inputs
import report
import timeline
from radiance_ar.envs import OVERLAP_PLANS, BackendSettings
from radiance_ar.transport.world import World
from radiance_ar.overlap import producers
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
from radiance_ar.overlap.pipeline import reduce_slices
from radiance_ar.overlap.plan import input_view, row_bounds
from radiance_ar.overlap.scratch import ScratchPool


@dataclass
class Case:
    backend: str
    rows: int
    cols: int
    k: int
    slices: int
    reps: int
    warmup: int
    seed: int = 0
    producer: str = "bf16"
    #: record one op call's device events (GPU worlds; see tools/timeline.py)
    timeline: bool = False
    #: the op's slicing plan (radiance_ar/overlap/slicing.py: uniform or growing)
    plan: str = OVERLAP_PLANS[0]

    def label(self) -> str:
        """``backend M=.. S=..`` and the plan where it is not the default (progress lines)."""
        return f"{self.backend} M={self.rows} {report.slicing_label((self.slices, self.plan))}"


def shard(case: Case, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s activation and weight shard, the same wherever it is built (fresh
    tensors on every call: callers may write into them)."""
    x, w = _cpu_shard(case.seed, rank, case.rows, case.cols, case.k)
    return x.to(device, copy=True), w.to(device, copy=True)


@functools.lru_cache(maxsize=8)
def _cpu_shard(seed: int, rank: int, rows: int, cols: int, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    # Kept for the next case of the same seed and shape (tools/tune.py gives every case of
    # a shape one seed): at M = 16384, K = 4352, N = 8192 one rank's shard takes 0.9 s of
    # CPU randn (2-core machine, 2026-12-04), the biggest cost of a tune case. 8 entries of
    # that size hold ~1.7 GB of host memory.
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(cols, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    return x, w


def timed_ms(world: World, fn, reps: int, warmup: int) -> tuple[float, ...]:
    """(median, spread[, host median]) of ``fn(i)`` in ms: on a GPU device-event and host
    times of samples that each start after a barrier, on the CPU ``perf_counter`` times of
    calls that each start after one."""
    if world.device.type == "cuda":
        # The barrier runs before the start event is recorded: it is not timed.
        return gpu_timing.device_and_host_ms(fn, reps, warmup, before=world.memory.barrier)
    for i in range(warmup):
        fn(i)
    samples = []
    for i in range(reps):
        world.memory.barrier()
        t0 = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - t0) * 1e3)
    return metrics.median_and_spread(samples)


def time_calls(record: dict, backend, ar_in: torch.Tensor, ar_out: torch.Tensor, case: Case,
               fns: dict, timer) -> tuple[list[int], dict]:
    """Time each of ``fns`` (gemm, ar, serial, ovl) with ``timer`` (fn -> median, spread
    and, on a GPU, the host's median) into ``record`` as ``t_<key>_ms`` /
    ``t_<key>_spread_ms`` / ``t_<key>_host_ms``; where the op slices, also
    ``ar_sliced``: the AR of the whole tensor called once per row slice, as the op calls
    it (a step the op runs ahead on the GEMM's stream, ``Backend.encode_ahead``, is inside
    each call here: the bound then counts it once, on the AR's side). Returns (the op's
    row bounds: S clamped to M rows, the medians by key, and by ``<key>_host`` the host's
    medians where the timer gives them)."""
    bounds = slice_plan(case, case.slices)

    def ar_sliced(i):
        reduce_slices(backend, ar_in, ar_out, bounds)

    timed = list(fns.items())
    if len(bounds) > 2:  # one slice is the unsliced AR: no overhead to measure
        timed.insert(2, ("ar_sliced", ar_sliced))
    times = {"ar_sliced": None}
    for key, fn in timed:
        med, spread, *host = timer(fn)
        times[key] = med
        record[f"t_{key}_ms"], record[f"t_{key}_spread_ms"] = med, spread
        if host:
            record[f"t_{key}_host_ms"] = times[f"{key}_host"] = host[0]
    return bounds, times


def digest(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def measure(world: World, case: Case) -> dict:
    """Collective. A record (rank 0's errors and timings; every rank's digest)."""
    knobs = BackendSettings.from_env()  # the environment's backend knobs, as in a deployment
    rt = overlap.build(world, OverlapSettings(True, case.backend, 1, case.slices, knobs,
                                              plan=case.plan))
    stock = overlap.build(world, OverlapSettings(True, "stock", 1, 1, knobs))
    try:
        return _measure(world, case, rt, stock)
    finally:
        rt.close()
        stock.close()


def slice_plan(case: Case, slices: int) -> list[int]:
    """The op's row bounds for ``case`` cut into ``slices`` (``plan.row_bounds``: the
    producer's alignment, the case's plan)."""
    return row_bounds(producers.get(case.producer), case.rows, slices, case.plan)


def slice_schedule(backend, case: Case, slices: int, dtype: torch.dtype) -> str | None:
    """The schedule the op's largest slice runs (``Backend.call_schedule``)."""
    bounds = slice_plan(case, slices)
    rows = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return backend.call_schedule(rows, case.cols, dtype)


def op_wire_bytes(backend, case: Case, slices: int, world_size: int, elem_size: int) -> int:
    """Bytes this rank pulls over the op's slice calls, each under its own schedule (a
    slice can run one-shot where the whole tensor would run two-shot: twice the bytes at
    W = 4); ``wire_bytes`` is the unsliced call's, whose time ``t_ar`` is."""
    bounds = slice_plan(case, slices)
    return sum(backend.wire_bytes((b - a) * case.cols, world_size, elem_size)
               for a, b in zip(bounds[:-1], bounds[1:]))


def verify(world: World, case: Case, rt: overlap.OverlapRuntime) -> tuple:
    """Collective: one op call of ``case`` on every rank against the float64 reference
    and the other ranks' bits. Returns (the record so far, x, w, the operands, the output)."""
    x, w = shard(case, world.rank, world.device)
    ops = producer_inputs.operands(case.producer, x, w)
    partial = producer_inputs.reference(ops)
    dist.all_reduce(partial, group=world.group)
    out = forward(rt, x, ops.weight, ops.weight_scale, case.producer)
    rel, max_abs = metrics.errors(out, partial)
    digests = [None] * world.size
    dist.all_gather_object(digests, digest(out), group=world.group)
    backend = rt.backend
    record = {
        "backend": case.backend, "producer": case.producer, "world": world.kind,
        "W": world.size, "M": case.rows, "N": case.cols, "K": case.k,
        "slices": case.slices if backend.pipelined else 1, "plan": case.plan,
        "rel_rms_err": rel, "rel_rms_bound": backend.rel_rms_bound, "max_abs_err": max_abs,
        "identical_on_ranks": len(set(digests)) == 1,
        "wire_bytes": backend.wire_bytes(case.rows * case.cols, world.size, out.element_size()),
        "emulated": world.emulated, "uses_cus_while_waiting": backend.uses_compute_units_while_waiting,
    }
    record["schedule"] = slice_schedule(backend, case, record["slices"], out.dtype)
    record["wire_bytes_op"] = op_wire_bytes(backend, case, record["slices"], world.size,
                                            out.element_size())
    record["correct"] = bool(rel <= backend.rel_rms_bound and record["identical_on_ranks"])
    return record, x, w, ops, out


def _measure(world: World, case: Case, rt: overlap.OverlapRuntime,
             stock: overlap.OverlapRuntime) -> dict:
    record, x, w, ops, out = verify(world, case, rt)
    if not record["correct"]:
        return record  # a wrong backend is reported as wrong, not timed
    backend = rt.backend

    y = torch.empty_like(out)
    ar_out = torch.empty_like(out)
    ar_in = input_view(backend, case.rows, case.cols, out.dtype, lambda: torch.empty_like(out))
    ar_in.copy_(out)

    gemm = producer_inputs.gemm_alone(ops, y, ScratchPool())

    def serial(i):
        forward(stock, x, ops.weight, ops.weight_scale, case.producer)

    def ovl(i):
        forward(rt, x, ops.weight, ops.weight_scale, case.producer)

    def ar(i):
        backend.all_reduce(ar_in, ar_out)

    bounds, times = time_calls(
        record, backend, ar_in, ar_out, case, {"gemm": gemm, "ar": ar, "serial": serial,
                                               "ovl": ovl},
        lambda fn: timed_ms(world, fn, case.reps, case.warmup))
    # Contention needs concurrent streams: measured on GPUs only.
    record.update({"contention": None, "contention_spread": None})
    if world.device.type == "cuda":
        record.update(gpu_timing.contention_record(gpu_timing.contention_times(
            gemm, ar, times["gemm"], times["ar"], case.reps, case.warmup,
            before=world.memory.barrier)))
        # the unsliced call's pieces: bus_gbs is the unsliced AR's rate (link module doc)
        gbs = link.link_gbs(world, record["wire_bytes"], 1, case.reps, case.warmup)
        record.update(metrics.derived(times, bounds, record["wire_bytes"], gbs))
        if case.timeline:
            world.memory.barrier()
            lead = timeline.LEAD_HOST_CALLS * record["t_ovl_host_ms"]
            path, events = timeline.record(rt, x, w, case.producer, lead_ms=lead)
            record["timeline"] = dict(timeline.summarize(events), path=path)
            record["timeline_events"] = events
    else:
        record.update(metrics.derived(times, bounds, record["wire_bytes"]))
    return record
