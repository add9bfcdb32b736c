"""Jobs for the sdma tests, run on every rank of a CPU world (module-level: pickled by name).

Inputs come from a generator seeded by (seed, call, rank), so any process can rebuild
every rank's inputs; the reference sum is computed with numpy float32 adds in rank
order, rounded once -- independent of the backend's torch and Triton reduces.
"""

from __future__ import annotations

import hashlib
import random
import time

import numpy as np
import torch

from radiance_ar import overlap
import world_jobs
from radiance_ar.envs import BackendSettings
from radiance_ar.backends.sdma import SdmaBackend
from radiance_ar.transport.world import World
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.slicing import slice_bounds

DT = torch.bfloat16


def make_input(seed: int, call: int, rank: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 7919 + call) * 131 + rank)
    # Magnitudes over 2^-6..2^6 so that the single rounding of the sum really matters.
    scale = torch.pow(2.0, torch.randint(-6, 7, (rows, cols), generator=g).float())
    return (torch.randn(rows, cols, generator=g) * scale).to(DT)


def reference(seed: int, call: int, size: int, rows: int, cols: int) -> torch.Tensor:
    acc = np.zeros((rows, cols), dtype=np.float32)
    for r in range(size):
        acc = acc + make_input(seed, call, r, rows, cols).float().numpy()  # fp32 add, rank order
    return torch.from_numpy(acc).to(DT)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(bits(t).numpy().tobytes()).hexdigest()


def exact_job(world: World, schedule: str, shapes: list, slices: int, seed: int,
              staged: bool) -> list:
    """For each (rows, cols): the AR of this rank's input, slice by slice, + bytes pulled."""
    be = SdmaBackend(world, BackendSettings(sdma_schedule=schedule))
    results = []
    for call, (rows, cols) in enumerate(shapes):
        be.ensure_capacity(rows, cols, DT)
        x = make_input(seed, call, world.rank, rows, cols)
        out = torch.full((rows, cols), float("nan"), dtype=DT)
        if staged:
            src = x
        else:
            src = be.acquire_input_view(rows, cols, DT)
            src.copy_(x)
        before = be.pulled_bytes
        bounds = slice_bounds(rows, slices)
        for a, b in zip(bounds[:-1], bounds[1:]):
            be.all_reduce(src[a:b], out[a:b])
        results.append((out, be.pulled_bytes - before,
                        [be.call_schedule(b - a, cols, DT) for a, b in zip(bounds[:-1], bounds[1:])]))
    be.close()
    return results


def long_job(world: World, schedule: str, calls: int, seed: int) -> dict:
    """``calls`` consecutive ARs of varying shape, slicing, staging and timing; checks each."""
    be = SdmaBackend(world, BackendSettings(sdma_schedule=schedule))
    plan = random.Random(seed)  # same plan on every rank
    jitter = random.Random(seed * 31 + world.rank)  # per-rank timing noise
    bad, hashes = [], []
    for call in range(calls):
        rows, cols = plan.randint(1, 48), plan.choice([8, 24, 64])
        slices, staged = plan.randint(1, 4), plan.random() < 0.25
        be.ensure_capacity(rows, cols, DT)
        x = make_input(seed, call, world.rank, rows, cols)
        out = torch.full((rows, cols), float("nan"), dtype=DT)
        src = x if staged else be.acquire_input_view(rows, cols, DT)
        if not staged:
            if jitter.random() < 0.3:
                time.sleep(jitter.uniform(0, 0.002))  # a slow producer: peers run ahead
            src.copy_(x)
        bounds = slice_bounds(rows, slices)
        for a, b in zip(bounds[:-1], bounds[1:]):
            be.all_reduce(src[a:b], out[a:b])
            if jitter.random() < 0.1:
                time.sleep(jitter.uniform(0, 0.001))
        if not torch.equal(bits(out), bits(reference(seed, call, world.size, rows, cols))):
            bad.append(call)
        hashes.append(digest(out))
    be.close()
    return {"bad": bad, "hashes": hashes}


def op_job(world: World, schedule: str, rows: int, cols: int, k: int, slice_counts: list,
           seed: int) -> list:
    """radiance::linear_ar's body through the sdma backend, for each slice count."""
    x, w = world_jobs.shard(seed, world.rank, rows, cols, k)
    outs = []
    knobs = BackendSettings(sdma_schedule=schedule)
    for s in slice_counts:
        rt = overlap.build(world, OverlapSettings(True, "sdma", 1, s, knobs))
        assert rt.backend.schedule == schedule
        outs.append(overlap.forward(rt, x, w, None, "bf16"))
        outs.append(overlap.forward(rt, x, w, None, "bf16"))  # reuse of the same buffers
        rt.close()
    return outs
