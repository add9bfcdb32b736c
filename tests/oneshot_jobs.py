"""Jobs for the oneshot_wht6 tests, run on every rank of a CPU world (module-level: pickled
by name), and the inputs/references the GPU tests share.

Inputs come from a generator seeded by (seed, call, rank), so any process can rebuild
every rank's input. Two references: the float64 sum of the inputs (the accuracy
contract, ``rel_rms_bound``) and the codec's own result for the W payloads in rank order
(``wht6.decode_accumulate`` of each rank's ``wht6.encode``), which the transport must
reproduce bit for bit: a stale or torn payload cannot hide behind the error bound.
"""

from __future__ import annotations

import hashlib
import random
import time

import torch

from radiance_ar import overlap
import world_jobs
from radiance_ar import wht6
from radiance_ar.backends.oneshot_wht6 import OneshotWht6Backend
from radiance_ar.transport.world import World
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.slicing import slice_bounds

DT = torch.bfloat16


def make_input(seed: int, call: int, rank: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 7919 + call) * 131 + rank)
    # Row scales over 2^-4..2^4: blocks of very different magnitude in one call.
    scale = torch.pow(2.0, torch.randint(-4, 5, (rows, 1), generator=g).float())
    return (torch.randn(rows, cols, generator=g) * scale).to(DT)


def reference(seed: int, call: int, size: int, rows: int, cols: int) -> torch.Tensor:
    return sum(make_input(seed, call, r, rows, cols).double() for r in range(size))


def codec_result(xs: list[torch.Tensor], dtype: torch.dtype = DT) -> torch.Tensor:
    """The codec's sum of the inputs' payloads, in rank order, on their device."""
    return wht6.decode_accumulate([wht6.encode(x) for x in xs], tuple(xs[0].shape), dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(bits(t).numpy().tobytes()).hexdigest()


def payload_bytes(rows: int, cols: int) -> int:
    """Bytes of the payload the codec makes of a [rows, cols] slice (counted, not computed)."""
    return wht6.encode(torch.zeros(rows, cols)).numel()


def slices_job(world: World, shapes: list, slices: int, seed: int) -> list:
    """For each (rows, cols): the AR of this rank's input slice by slice into a NaN-poisoned
    output, the bytes pulled from peers, and wire_bytes summed over the slices."""
    be = OneshotWht6Backend(world)
    results = []
    for call, (rows, cols) in enumerate(shapes):
        be.ensure_capacity(rows, cols, DT)
        x = make_input(seed, call, world.rank, rows, cols)
        out = torch.full((rows, cols), float("nan"), dtype=DT)
        before, wire = be.pulled_bytes, 0
        bounds = slice_bounds(rows, slices)
        for a, b in zip(bounds[:-1], bounds[1:]):
            be.all_reduce(x[a:b], out[a:b])
            wire += be.wire_bytes((b - a) * cols, world.size)
        results.append((out, be.pulled_bytes - before, wire))
    be.close()
    return results


def long_job(world: World, calls: int, seed: int) -> dict:
    """``calls`` consecutive ARs of varying shape with per-rank timing noise; each result is
    checked against the codec's exact result and the float64 bound."""
    be = OneshotWht6Backend(world)
    plan = random.Random(seed)  # same plan on every rank
    jitter = random.Random(seed * 31 + world.rank)  # per-rank timing noise
    bad, hashes = [], []
    for call in range(calls):
        rows, cols = plan.randint(1, 24), plan.choice([256, 512, 768])
        be.ensure_capacity(rows, cols, DT)
        x = make_input(seed, call, world.rank, rows, cols)
        out = torch.full((rows, cols), float("nan"), dtype=DT)
        if jitter.random() < 0.2:
            time.sleep(jitter.uniform(0, 0.002))  # a slow rank: its peers run ahead
        be.all_reduce(x, out)
        want = codec_result([make_input(seed, call, r, rows, cols) for r in range(world.size)])
        ref = reference(seed, call, world.size, rows, cols)
        if not torch.equal(bits(out), bits(want)) or world_jobs.rel_rms(out, ref) > be.rel_rms_bound:
            bad.append(call)
        hashes.append(digest(out))
    be.close()
    return {"bad": bad, "hashes": hashes}


def passive_job(world: World, rows: int, cols: int) -> list | None:
    """Rank 0 alone against passive peers (timing mode): each call, at either region
    parity, must sum its own payload and the peers' pre-filled valid payloads."""
    be = OneshotWht6Backend(world)
    be.ensure_capacity(rows, cols, DT)  # collective: every rank allocates
    if world.rank != 0:
        return None
    be.fill_passive_peers(seed=5)
    sample = wht6.encode(torch.randn(rows, cols, generator=torch.Generator().manual_seed(5))
                         .to(DT))  # what fill_passive_peers wrote (rows <= 64)
    same = []
    for call in range(3):
        r = rows - call
        x = make_input(4, call, 0, r, cols)
        out = torch.full((r, cols), float("nan"), dtype=DT)
        be.all_reduce(x, out)
        want = wht6.decode_accumulate([wht6.encode(x)] + [sample[:r]] * (world.size - 1),
                                      (r, cols), DT)
        same.append(bool(torch.equal(bits(out), bits(want))))
    be.close()
    return same


def op_job(world: World, rows: int, cols: int, k: int, slice_counts: list, seed: int) -> list:
    """radiance::linear_ar's body through oneshot_wht6, twice per slice count."""
    x, w = world_jobs.shard(seed, world.rank, rows, cols, k)
    outs = []
    for s in slice_counts:
        rt = overlap.build(world, OverlapSettings(True, "oneshot_wht6", 1, s))
        outs.append(overlap.forward(rt, x, w, None, "bf16"))
        outs.append(overlap.forward(rt, x, w, None, "bf16"))  # reuse of the same buffers
        rt.close()
    return outs
