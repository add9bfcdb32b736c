"""Jobs for the sdma_wht6 tests (module-level: the CPU world pickles them by name).

The references are built from the codec's plain-torch reference functions
(``radiance_ar.wht6.reference``), never through the backend or its transport: one-shot
must equal the decode-accumulate of every rank's payload in rank order, two-shot the
same sum encoded and decoded once more, bit for bit.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from radiance_ar import overlap
from oneshot_jobs import make_input  # codec-friendly inputs (row scales 2^-4..2^4)
from radiance_ar.backends import sdma_schedule
from radiance_ar.envs import BackendSettings
from radiance_ar.backends.sdma_wht6 import SdmaWht6Backend
from radiance_ar.wht6 import reference as codec
from radiance_ar.transport.world import World
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.slicing import slice_bounds

DT = torch.bfloat16


def codec_reference(xs: list[torch.Tensor], schedule: str) -> torch.Tensor:
    """What every rank must hold for inputs ``xs`` (rank order): one-shot
    decode_accumulate(encodes); two-shot decode(encode(that))."""
    shape = tuple(xs[0].shape)
    summed = codec.decode_accumulate([codec.encode(x) for x in xs], shape, DT)
    return summed if schedule == "oneshot" else codec.decode(codec.encode(summed), shape, DT)


def rel_rms(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()


def exact_job(world: World, shapes: list, slices: int, seed: int, schedule: str) -> list:
    """For each (rows, cols): the AR of this rank's input slice by slice (NaN-poisoned
    output), whether it equals the codec reference, the bytes pulled against wire_bytes,
    the schedule each slice ran and the error against the float64 sum."""
    be = SdmaWht6Backend(world, BackendSettings(sdma_schedule=schedule))
    results = []
    for call, (rows, cols) in enumerate(shapes):
        be.ensure_capacity(rows, cols, DT)
        xs = [make_input(seed, call, r, rows, cols) for r in range(world.size)]
        out = torch.full((rows, cols), float("nan"), dtype=DT)
        before = be.pulled_bytes
        bounds = list(zip(slice_bounds(rows, slices)[:-1], slice_bounds(rows, slices)[1:]))
        ran = []
        for a, b in bounds:
            be.all_reduce(xs[world.rank][a:b], out[a:b])
            ran.append(be.call_schedule(b - a, cols, DT))
        expected = torch.cat([codec_reference([x[a:b] for x in xs], s)
                              for (a, b), s in zip(bounds, ran)])
        exact = torch.stack([x.double() for x in xs]).sum(0)
        results.append({"out": out, "matches_codec": torch.equal(out, expected), "ran": ran,
                        "pulled": be.pulled_bytes - before,
                        "wire": sum(be.wire_bytes((b - a) * cols, world.size) for a, b in bounds),
                        "rel_rms": rel_rms(out, exact), "bound": be.rel_rms_bound})
    be.close()
    return results


def auto_job(world: World, shapes: list, min_bytes: int) -> list:
    """``exact_job`` of ``auto`` with the two-shot threshold of ``auto_schedule_wht6``
    set to ``min_bytes`` in this rank's process."""
    sdma_schedule.AUTO_WHT6_TWOSHOT_MIN_BYTES = min_bytes
    return exact_job(world, shapes, 1, 7, "auto")


def long_job(world: World, calls: int, seed: int, schedule: str) -> list:
    """``calls`` consecutive calls of varying rows, cols and slicing, with per-rank
    delays (peers run ahead into the next call's encode and re-encode, which the reuse
    fence must hold back); per call, whether it was the codec reference."""
    be = SdmaWht6Backend(world, BackendSettings(sdma_schedule=schedule))
    plan = random.Random(seed)  # the same plan on every rank
    jitter = random.Random(seed * 31 + world.rank)
    right = []
    for call in range(calls):
        rows, cols, slices = plan.randint(1, 24), plan.choice([256, 768]), plan.randint(1, 3)
        be.ensure_capacity(rows, cols, DT)
        xs = [make_input(seed, call, r, rows, cols) for r in range(world.size)]
        out = torch.full((rows, cols), float("nan"), dtype=DT)
        bounds = list(zip(slice_bounds(rows, slices)[:-1], slice_bounds(rows, slices)[1:]))
        for a, b in bounds:
            if jitter.random() < 0.3:
                time.sleep(jitter.uniform(0, 0.002))
            be.all_reduce(xs[world.rank][a:b], out[a:b])
        want = torch.cat([codec_reference([x[a:b] for x in xs], schedule) for a, b in bounds])
        right.append(torch.equal(out, want))
    be.close()
    return right


def op_job(world: World, rows: int, cols: int, k: int, slices: int, seed: int,
           schedule: str = "auto") -> dict:
    knobs = BackendSettings(sdma_schedule=schedule)
    rt = overlap.build(world, OverlapSettings(True, "sdma_wht6", 1, slices, knobs))
    g = torch.Generator().manual_seed(seed * 100 + world.rank)
    x = torch.randn(rows, k, generator=g).to(DT)
    w = (torch.randn(cols, k, generator=g) / k ** 0.5).to(DT)
    out = overlap.forward(rt, x, w, None, "bf16")
    exact = (x.double() @ w.double().t())
    dist.all_reduce(exact, group=world.group)
    rt.close()
    return {"out": out, "rel_rms": rel_rms(out, exact), "bound": rt.backend.rel_rms_bound}


def staged_op_job(world: World, calls: int, cols: int, k: int, slices: int, seed: int,
                  schedule: str) -> dict:
    """``calls`` op calls of varying M (per-rank delays between them) on a runtime whose
    transport stages its publishes as the host-memory worlds do (forced: CPU worlds
    publish in place), so each slice is encoded ahead into the stage at its own rows;
    and the same calls on a runtime that encodes inside the all-reduce. Per call: both
    outputs, each slice encoded ahead as (its first row, its stage address mod 16), and
    every pull's destination bytes (start address, length)."""
    knobs = BackendSettings(sdma_schedule=schedule)
    runtimes = [overlap.build(world, OverlapSettings(True, "sdma_wht6", 1, slices, knobs))
                for _ in range(2)]
    staged = runtimes[0].backend
    staged.transport.buffers.staged = True  # before the first growth allocates the stage
    encoded_ahead = []
    encode_ahead = staged.encode_ahead

    def spy(y: torch.Tensor, row0: int):
        done = encode_ahead(y, row0)
        if done is not None:
            encoded_ahead.append((row0, done.data_ptr() % 16))
        return done

    staged.encode_ahead = spy
    pulled_into = []
    pull_from = staged.transport.pull_from

    def pull_spy(slot, t, pulls, stream, what):
        pulled_into.extend((dst, nbytes) for _, dst, _, nbytes in pulls if nbytes)
        pull_from(slot, t, pulls, stream, what)

    staged.transport.pull_from = pull_spy
    plan = random.Random(seed)  # the same M and sleeps on every rank's plan
    jitter = random.Random(seed * 31 + world.rank)
    results = []
    for call in range(calls):
        rows = plan.randint(slices, 48)
        g = torch.Generator().manual_seed(seed * 1000 + call * 10 + world.rank)
        x = torch.randn(rows, k, generator=g).to(DT)
        w = (torch.randn(cols, k, generator=g) / k ** 0.5).to(DT)
        encoded_ahead.clear()
        pulled_into.clear()
        outs = []
        for rt in runtimes:
            if jitter.random() < 0.3:
                time.sleep(jitter.uniform(0, 0.002))
            outs.append(overlap.forward(rt, x, w, None, "bf16"))
        exact = x.double() @ w.double().t()
        dist.all_reduce(exact, group=world.group)
        results.append({"ahead": outs[0], "in_call": outs[1], "rows_ahead": list(encoded_ahead),
                        "pulled_into": list(pulled_into),
                        "rel_rms": rel_rms(outs[0], exact), "bound": staged.rel_rms_bound})
    for rt in runtimes:
        rt.close()
    return results


def _outcome(be: SdmaWht6Backend, world: World, seed: int, rows: int, cols: int) -> dict:
    """One two-shot call: {"error": type, "message"} or {"out", "right"} (the codec result)."""
    xs = [make_input(seed, 0, r, rows, cols) for r in range(world.size)]
    out = torch.full((rows, cols), float("nan"), dtype=DT)
    start = time.monotonic()
    try:
        be.all_reduce(xs[world.rank], out)
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        return {"error": type(e).__name__, "message": str(e),
                "elapsed": time.monotonic() - start}
    return {"out": out, "right": torch.equal(out, codec_reference(xs, "twoshot"))}


def reduced_phase_fault_job(world: World, fault: str, timeout_ms: float) -> dict:
    """Rank 1 fails between its reduce-scatter and its all-gather, in a two-shot call:
    ``"raise"``: its call raises just before it publishes its reduced shard (its abort
    word tells the peers); ``"stall"``: it publishes that shard 1.5 bounds late, which
    its peers cannot tell from a rank that died there. Then a second call (refused
    everywhere), ``resync()`` on every rank and a good call."""
    be = SdmaWht6Backend(world, BackendSettings(sdma_schedule="twoshot",
                                                spin_timeout_ms=timeout_ms))
    rows, cols = 8, 256
    be.ensure_capacity(rows, cols, DT)
    res = {"warm": _outcome(be, world, 1, rows, cols)}
    dist.barrier(group=world.group)
    if world.rank == 1:
        publish = be.transport.publish

        def faulty(t, slot, *args, **kwargs):
            if slot == "reduced":
                if fault == "raise":
                    raise RuntimeError("rank 1 failed before publishing its reduced shard")
                time.sleep(1.5 * timeout_ms / 1000.0)
            return publish(t, slot, *args, **kwargs)

        be.transport.publish = faulty
    res["faulty"] = _outcome(be, world, 2, rows, cols)
    if world.rank == 1:
        del be.transport.publish  # the class's method again
    res["next"] = _outcome(be, world, 3, rows, cols)
    dist.barrier(group=world.group)
    be.resync()
    res["after_resync"] = _outcome(be, world, 4, rows, cols)
    be.close()
    return res
