"""One (backend, M, slices) measurement with W emulated ranks on one GPU (docs/design.md, 'Worlds').

Every rank's peer-visible buffers sit in pinned host memory, so every cross-rank byte
crosses PCIe, as on a PCIe multi-GPU box. Two phases:

1. Verify with all W ranks, each on its own stream: the op's result on every rank
   against a float64 sum of the W partial products; same bits on every rank.
2. Time ONE active rank against W-1 passive peers whose payloads and flags are already
   in host memory (``Backend.fill_passive_peers``): one GPU has one host link where W
   real ranks would have W, so running W active ranks would time a link W-way shared.

Timing covers GEMM, AR, the AR as S slice calls, serial and overlapped op, contention,
the raw host link (:mod:`link`) and, with ``Case.timeline``, one op call's events.
The serial baseline here is GEMM then this backend's unsliced AR (there is no vendor
collective between emulated ranks); every figure is labelled "1 GPU, W emulated ranks".
"""

from __future__ import annotations

import torch

import gpu_timing
import link
import metrics
from radiance_ar import overlap
import producer_inputs
import timeline
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import World, emulated_worlds
from radiance_ar.harness.emulated import EmulatedRanks
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
from radiance_ar.overlap.plan import input_view
from radiance_ar.overlap.scratch import ScratchPool
from world_measure import Case, op_wire_bytes, shard, slice_plan, slice_schedule, time_calls
from world_measure import verify as verify_world


def poison_allocator(shape: tuple[int, int], device: torch.device) -> None:
    """Leave NaN in the block the op's next ``torch.empty`` of this shape will likely get,
    so an element the backend forgot to write shows up as NaN, not as an old result."""
    torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def verify(case: Case, size: int, device: torch.device) -> dict:
    ranks = EmulatedRanks(size, device)
    settings = OverlapSettings(True, case.backend, 1, case.slices, BackendSettings.from_env(),
                               plan=case.plan)
    runtimes = [overlap.build(w, settings) for w in ranks.worlds]
    data = [producer_inputs.operands(case.producer, *shard(case, rank, device))
            for rank in range(size)]
    bounds = slice_plan(case, case.slices)
    ref = sum(producer_inputs.reference(ops) for ops in data)

    def grow(rank: int) -> None:
        runtimes[rank].backend.ensure_capacity(case.rows, case.cols, torch.bfloat16)
        # The GEMM library picks (and may load or compile) a kernel per slice shape, and
        # the producer grows its scratch: run the rank's slices once now.
        producer_inputs.warm_up(data[rank], bounds, runtimes[rank].scratch)

    ranks.prepare(grow)
    poison_allocator((case.rows, case.cols), device)
    outs = ranks.each(lambda r: forward(runtimes[r], data[r].x, data[r].weight,
                                        data[r].weight_scale, case.producer))
    for rt in runtimes:  # bounded: a rank parked on a peer raises (and is released) here,
        rt.backend.check()  # where a device synchronize would wait for it for good
    torch.cuda.synchronize(device)
    errs = [metrics.errors(o, ref) for o in outs]
    rel = max(e[0] for e in errs)
    backend = runtimes[0].backend
    record = {"rel_rms_err": rel, "max_abs_err": max(e[1] for e in errs),
              # the bits (a value compare takes -0 for +0 and no NaN for another)
              "identical_on_ranks": all(torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8))
                                        for o in outs),
              "finite": all(bool(torch.isfinite(o).all()) for o in outs)}
    record["correct"] = bool(rel <= backend.rel_rms_bound and record["identical_on_ranks"]
                             and record["finite"])
    for rt in runtimes:
        rt.close()
    return record


def measure_emulated(case: Case, size: int, device: torch.device, op_only: bool = False) -> dict:
    """Verify with W active ranks, then time one active rank (see module doc).
    ``op_only`` (tools/tune.py): time the op alone (``t_ovl_ms``), nothing else."""
    record = {"backend": case.backend, "producer": case.producer, "world": "gpu-emulated",
              "W": size, "M": case.rows,
              "N": case.cols, "K": case.k, "slices": case.slices, "plan": case.plan,
              "emulated": True,
              "baseline": "GEMM then this backend's unsliced AR"}
    record.update(verify(case, size, device))
    if not record["correct"]:
        return record
    world = emulated_worlds(size, device)[0]
    rt, serial_rt = active_runtimes(world, case, op_only)
    try:
        time_active_rank(record, case, rt, serial_rt)
    finally:
        rt.close()
        if serial_rt is not None:
            serial_rt.close()
        # Each case's runtimes capture graphs into a private pool of their own; closed,
        # that pool's memory stays reserved until emptied (2 GiB a case at W = 4, N = 8192
        # on the H200: 86 GiB after 84 cases). Left to grow, the allocator frees it itself
        # on a later allocation with a device synchronization, and a synchronization while
        # an emulated peer is parked in a device wait never returns: the 2026-12-04 tune
        # hung so at case 346. Here no stream waits, so emptying is safe.
        torch.cuda.empty_cache()
    return record


def active_runtimes(world, case: Case, op_only: bool = False
                    ) -> tuple[overlap.OverlapRuntime, overlap.OverlapRuntime | None]:
    """The op's runtime of ``case`` and its serial baseline's (the same backend, one slice;
    None for ``op_only``) for ``world`` (collective where the world's memory is)."""
    knobs = BackendSettings.from_env()  # the environment's backend knobs, as in a deployment
    rt = overlap.build(world, OverlapSettings(True, case.backend, 1, case.slices, knobs,
                                              plan=case.plan))
    # op_only: no serial arm, so no second runtime to grow and fill
    serial_rt = None if op_only else overlap.build(world, OverlapSettings(True, case.backend,
                                                                          1, 1, knobs))
    return rt, serial_rt


def time_active_rank(record: dict, case: Case, rt: overlap.OverlapRuntime,
                     serial_rt: overlap.OverlapRuntime | None) -> None:
    """Phase 2 (module doc) on the rank of ``rt``'s world: its peers made passive, every
    timing of ``case`` into ``record`` (``serial_rt`` None: the op alone, ``t_ovl_ms``).
    The world's peers must make no call meanwhile (emulated: they are not driven;
    processes: they wait at a barrier)."""
    op_only = serial_rt is None
    world, backend = rt.world, rt.backend
    size, device = world.size, world.device
    ops = producer_inputs.operands(case.producer, *shard(case, world.rank, device))
    xs = [ops.x] + [ops.x.clone() for _ in range(gpu_timing.copies_for(ops.x) - 1)]
    y = torch.empty(case.rows, case.cols, dtype=torch.bfloat16, device=device)
    for r in [rt] + ([] if op_only else [serial_rt]):
        r.backend.ensure_capacity(case.rows, case.cols, y.dtype)
        r.backend.fill_passive_peers()
    record["schedule"] = slice_schedule(backend, case, case.slices, y.dtype)
    if op_only:
        def op(i):
            forward(rt, xs[i % len(xs)], ops.weight, ops.weight_scale, case.producer)

        med, spread, host = gpu_timing.device_and_host_ms(op, case.reps, case.warmup)
        record.update(t_ovl_ms=med, t_ovl_spread_ms=spread, t_ovl_host_ms=host,
                      op_graphs=rt.graph_reason() or "replayed")
        return
    ar_in = input_view(backend, case.rows, case.cols, y.dtype, lambda: torch.randn_like(y))
    ar_out = torch.empty_like(y)

    gemm = producer_inputs.gemm_alone(ops, y, ScratchPool(), xs)

    def ar(i):
        backend.all_reduce(ar_in, ar_out)

    def ovl(i):
        forward(rt, xs[i % len(xs)], ops.weight, ops.weight_scale, case.producer)

    def serial(i):
        forward(serial_rt, xs[i % len(xs)], ops.weight, ops.weight_scale, case.producer)

    bounds, times = time_calls(
        record, backend, ar_in, ar_out, case, {"gemm": gemm, "ar": ar, "serial": serial,
                                               "ovl": ovl},
        lambda fn: gpu_timing.device_and_host_ms(fn, case.reps, case.warmup))
    record.update(gpu_timing.contention_record(gpu_timing.contention_times(
        gemm, ar, times["gemm"], times["ar"], case.reps, case.warmup)))
    record["wire_bytes"] = backend.wire_bytes(case.rows * case.cols, size, y.element_size())
    record["wire_bytes_op"] = op_wire_bytes(backend, case, case.slices, size, y.element_size())
    # The raw link: H2D copies from pinned host memory of this process (a fresh emulated
    # world, its buffers not the backends'), the copies a pull of host-memory peers makes.
    # the unsliced call's pieces: bus_gbs is the unsliced AR's rate (link module doc)
    gbs = link.link_gbs(emulated_worlds(size, device)[0], record["wire_bytes"], 1, case.reps,
                        case.warmup)
    record.update(metrics.derived(times, bounds, record["wire_bytes"], gbs))
    if case.timeline:
        lead = timeline.LEAD_HOST_CALLS * record["t_ovl_host_ms"]
        path, events = timeline.record(rt, xs[0], ops.weight, case.producer, lead_ms=lead)
        record["timeline"] = dict(timeline.summarize(events), path=path)
        record["timeline_events"] = events
    record["uses_cus_while_waiting"] = backend.uses_compute_units_while_waiting
    # what the timed op calls were: replayed graphs, or why each step was enqueued
    record["op_graphs"] = rt.graph_reason() or "replayed"


def measure_one_active(world: World, case: Case) -> dict:
    """Collective, for ranks in processes that share one GPU (gpu-host): verify with every
    rank active, then time rank 0 alone against passive peers (its peers' buffers and
    flags are shared host memory it fills; they wait at a barrier meanwhile), as the
    emulated world times (above): ranks that time-slice one GPU would otherwise time each
    other. A record (rank 0's timings; every rank's errors and digests)."""
    rt, serial_rt = active_runtimes(world, case)
    try:
        # Every buffer sized and kernel loaded on every rank now: these are collective,
        # and rank 0 will time alone.
        for r in (rt, serial_rt):
            r.backend.ensure_capacity(case.rows, case.cols, torch.bfloat16)
        record = verify_world(world, case, rt)[0]
        record.update(baseline="GEMM then this backend's unsliced AR",
                      timing="one active rank against passive peers")
        if record["correct"]:
            world.memory.barrier()
            if world.rank == 0:
                time_active_rank(record, case, rt, serial_rt)
            world.memory.barrier()
        return record
    finally:
        rt.close()
        serial_rt.close()
