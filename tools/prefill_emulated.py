"""The prefill arms in W emulated ranks on one GPU (docs/design.md, 'Worlds'); see
tools/prefill_measure.py for the arms, the checks and the timing.

Verification runs all W ranks, each on its own stream, in lockstep over the stack's
components (:func:`prefill_stack.run_lockstep`), with every RowParallel call checked
against the float64 sum of the W partials of that call. Timing then runs ONE active
rank against W-1 passive peers (``Backend.fill_passive_peers``): one GPU has one host
link where W real ranks would have W. The off arm here is the same backend at one
slice (GEMM then its unsliced all-reduce): there is no vendor collective between
emulated ranks. Timed outputs are not sums over ranks; the verified ones are.
"""

from __future__ import annotations

import torch

from radiance_ar import backends
import metrics
from radiance_ar import overlap
from radiance_ar.call_contract import CollectiveError
from radiance_ar.backends.interface import Backend
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.harness.emulated import EmulatedRanks
from prefill_measure import (Spec, add_bound, add_figures, arm_slices, chunk_bounds, gate_reason,
                             off_arm_parts, op_of, settings, time_prefill, verdict)
from prefill_stack import DTYPE, ShardModel, prefill_steps, run_alone, run_lockstep


def lockstep_checked(models: list[ShardModel], chunks, ops: list, streams=None
                     ) -> tuple[list[torch.Tensor], list[float], bool]:
    """All W ranks of one process through the prefill in lockstep (rank r calls
    ``ops[r]`` for its RowParallel linears; ``streams[r]`` its stream, or None). After
    every step that made collective calls the device is synchronized (every rank has
    issued its call by then, so nothing can wait on a later host call) and each rank's
    output is checked against the float64 sum of the W partials of that call.
    Returns (each rank's stack output, every call's relative RMS error, whether every
    call gave the same bits on every rank)."""
    pending, rels, same = [], [], [True]
    cuda = models[0].device.type == "cuda"

    def checked_for(rank):
        def checked(x, w):
            out = ops[rank](x, w)
            pending.append((rank, x, w, out))
            return out
        return checked

    def after_step():
        if not pending:
            return
        if cuda:
            torch.cuda.synchronize()
        exact = sum(models[r].gemm(x, w).double() for r, x, w, _ in pending)
        for _, _, _, out in pending:
            rels.append(metrics.errors(out, exact)[0])
            same[0] = same[0] and torch.equal(out, pending[0][3])
        pending.clear()

    outs = run_lockstep([prefill_steps(m, chunks, checked_for(r)) for r, m in enumerate(models)],
                        streams, after_step)
    if cuda:
        torch.cuda.synchronize()
    return [torch.cat(o) for o in outs], rels, same[0]


def _verify_emulated(spec: Spec, models, chunks, name: str, device) -> tuple[dict, dict]:
    """The off and on arms of backend ``name`` with all W ranks active (each its stream)."""
    ranks = EmulatedRanks(len(models), device)
    off_rts = [overlap.build(w, settings(spec, name, 1)) for w in ranks.worlds]
    on_rts = [overlap.build(w, settings(spec, name)) for w in ranks.worlds]
    try:
        def grow(rank: int) -> None:
            for rt in (off_rts[rank], on_rts[rank]):
                rt.backend.ensure_capacity(max(spec.chunk_rows), spec.shapes.hidden, DTYPE)

        ranks.prepare(grow)
        streams = ranks.streams
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(device))
        arms = {}
        for arm, rts in (("off", off_rts), ("on", on_rts)):
            outs, rels, same = lockstep_checked(
                models, chunks, [op_of(rt, spec.producer) for rt in rts], streams)
            errors = []
            for rt in rts:
                try:
                    rt.backend.check()
                except CollectiveError as e:
                    errors.append(str(e))
            finite = all(bool(torch.isfinite(o).all()) for o in outs)
            stack_rel = (None if arm == "off"
                         else metrics.errors(outs[0], arms["off"][1].double())[0])
            rec = verdict(spec, rts[0].backend.rel_rms_bound, rels,
                          same and all(torch.equal(o, outs[0]) for o in outs), finite, stack_rel)
            if errors:
                rec.update(correct=False, error="; ".join(errors))
            arms[arm] = (rec, outs[0])
        return arms["off"][0], arms["on"][0]
    finally:
        for rt in off_rts + on_rts:
            rt.close()


def op_slice_rows(spec: Spec, model: ShardModel) -> set[int]:
    """The row counts of every GEMM slice the on arms' op calls cut the chunks into
    (:func:`prefill_measure.chunk_bounds`)."""
    sizes = set()
    for name in spec.backends:
        for rows in set(spec.chunk_rows):
            bounds = chunk_bounds(spec, model.producer, name, rows)
            sizes.update(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return sizes


def warm_local_kernels(spec: Spec, model: ShardModel, chunks) -> None:
    """Run every rank-local kernel shape once on the default stream (the stack with a
    local GEMM in place of the op, and the GEMM of every slice the op will cut:
    :func:`op_slice_rows`), so no first use can synchronize the device while an
    emulated rank's stream waits."""
    run_alone(prefill_steps(model, chunks, model.gemm))
    for rows in sorted(op_slice_rows(spec, model)):
        for w in (model.layers[0].o_proj, model.layers[0].down_proj):
            model.gemm(torch.zeros(rows, model.inner(w), dtype=DTYPE, device=model.device), w)
    torch.cuda.synchronize()


def emulated_run(spec: Spec, device: torch.device, log=print) -> list[dict]:
    """Every backend of ``spec.backends`` in W = tp emulated ranks: verify with W active
    ranks, then time one active rank against W-1 passive peers (docs/design.md, 'Worlds')."""
    size = spec.shapes.tp
    models = [spec.model(r, device) for r in range(size)]
    chunks = spec.chunks(device)
    warm_local_kernels(spec, models[0], chunks)
    probe = emulated_worlds(size, device)[0]
    base = {"world": probe.kind, "W": size, "tokens": spec.tokens, "chunks": len(spec.chunk_rows),
            "layers": spec.layers, "producer": spec.producer, "emulated": True}
    records = []
    for name in spec.backends:
        reason = gate_reason(name, probe, spec.shapes.hidden)
        if reason is not None:
            records.append(dict(base, arm="on", backend=name, skipped=reason, correct=None))
            continue
        log(f"{name}: verifying with {size} active ranks ...")
        off, on = _verify_emulated(spec, models, chunks, name, device)
        off = dict(base, arm="off", backend=name, slices=1, **off)
        on = dict(base, arm="on", backend=name, slices=arm_slices(spec, name), **on)
        records += [off, on]
        if not (off["correct"] and on["correct"]):
            continue
        if backends.get(name).fill_passive_peers is Backend.fill_passive_peers:
            off["timing_skipped"] = on["timing_skipped"] = (
                f"backend {name!r} has no passive-peer timing mode (fill_passive_peers)")
            continue
        log(f"{name}: timing one active rank against {size - 1} passive peers ...")
        _time_emulated(spec, models[0], chunks, name, device, off, on)
    return records


def _time_emulated(spec: Spec, model: ShardModel, chunks, name: str, device, off: dict,
                   on: dict) -> None:
    world = emulated_worlds(spec.shapes.tp, device)[0]
    off_rt = overlap.build(world, settings(spec, name, 1))
    on_rt = overlap.build(world, settings(spec, name))
    try:
        for rt in (off_rt, on_rt):
            rt.backend.ensure_capacity(max(spec.chunk_rows), spec.shapes.hidden, DTYPE)
            rt.backend.fill_passive_peers()
        off.update(time_prefill(model, chunks, op_of(off_rt, spec.producer), spec.reps,
                                spec.warmup))
        off.update(off_arm_parts(spec, model, off_rt.backend))
        add_figures(spec, off, None)
        on.update(time_prefill(model, chunks, op_of(on_rt, spec.producer), spec.reps,
                               spec.warmup))
        add_figures(spec, on, off)
        add_bound(spec, model, on, off)
    finally:
        off_rt.close()
        on_rt.close()
