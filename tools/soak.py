#!/usr/bin/env python3
"""Soak the op: many calls with random M in a CPU world, every result checked.

    python tools/soak.py --world 2 --calls 2000 --backends stock

Each call draws M in [1, --max-m] (so both the decode path and the sliced pipeline
run), compares every rank's output with a float64 reference (each rank's float64
partial product summed by a float64 all-reduce) within the backend's error bound, and
checks the bits are identical on every rank. At the end it prints calls/s, mismatches
and whether scratch and peer memory stayed flat after warm-up (it must: persistent buffers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import backends  # noqa: E402
import metrics  # noqa: E402
import overlap  # noqa: E402
from overlap.config import OverlapSettings  # noqa: E402
from overlap.op import forward  # noqa: E402


def memory_state(rt) -> tuple[int, int]:
    """(allocations, bytes) made so far by the op's scratch pool and the peer memory."""
    mem = rt.world.memory
    return (rt.scratch.growths + mem.allocations, rt.scratch.reserved_bytes() + mem.allocated_bytes)


def soak_job(world, backend: str, calls: int, seconds: float, max_m: int, cols: int, k: int,
             min_m: int, slices: int, seed: int) -> dict:
    """Collective. Runs until ``calls`` calls or ``seconds`` elapsed (rank 0 decides)."""
    reason = backends.get(backend).unsupported_reason(world)
    if reason is not None:
        return {"backend": backend, "skipped": reason}
    rt = overlap.build(world, OverlapSettings(True, backend, min_m, slices))
    gen = torch.Generator().manual_seed(seed)  # same M sequence on every rank
    wgen = torch.Generator().manual_seed(seed * 31 + world.rank)
    w = (torch.randn(cols, k, generator=wgen) / k ** 0.5).to(torch.bfloat16)
    x_all = torch.randn(max_m, k, generator=wgen).to(torch.bfloat16)
    bound = rt.backend.rel_rms_bound
    mismatches, done, warm = [], 0, None
    stop = torch.zeros(1)
    t0 = time.perf_counter()
    while done < calls:
        rows = int(torch.randint(1, max_m + 1, (1,), generator=gen))
        x = x_all[:rows]
        out = forward(rt, x, w, None, "bf16")
        ref = x.double() @ w.double().t()
        dist.all_reduce(ref, group=world.group)
        rel, _ = metrics.errors(out, ref)
        same = torch.zeros(1, dtype=torch.float64)
        same[0] = float(out.view(torch.int16).long().sum())
        lo, hi = same.clone(), same.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=world.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=world.group)
        if rel > bound or lo.item() != hi.item():
            mismatches.append({"call": done, "M": rows, "rel_rms_err": rel,
                               "identical_on_ranks": lo.item() == hi.item()})
        done += 1
        if done == min(calls, 50):
            warm = memory_state(rt)
        stop[0] = float(time.perf_counter() - t0 > seconds)
        dist.broadcast(stop, src=dist.get_global_rank(world.group, 0), group=world.group)
        if stop.item():
            break
    elapsed = time.perf_counter() - t0
    final = memory_state(rt)
    rt.close()
    return {"backend": backend, "calls": done, "seconds": elapsed, "mismatches": mismatches,
            "scratch_after_warmup": warm, "scratch_final": final}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="CPU processes (default 2)")
    p.add_argument("--backends", default=None, help="comma-separated; default every registered one")
    p.add_argument("--calls", type=int, default=2000, help="calls per backend (default 2000)")
    p.add_argument("--seconds", type=float, default=600.0, help="stop a backend after this long")
    p.add_argument("--max-m", type=int, default=96, help="largest M drawn (default 96)")
    p.add_argument("--min-m", type=int, default=32,
                   help="RADIANCE_AR_OVERLAP_MIN_M for the soak (default 32: both paths run)")
    p.add_argument("--slices", type=int, default=3, help="slices of the pipeline (default 3)")
    p.add_argument("--n", type=int, default=256,
                   help="output columns (default 256: one block of the wht6 codec)")
    p.add_argument("--k", type=int, default=32, help="input columns (default 32)")
    args = p.parse_args(argv)
    from backends.cpu_world import CpuWorldPool

    names = backends.names() if args.backends is None else args.backends.split(",")
    failed = False
    with CpuWorldPool(args.world) as pool:
        for name in names:
            r = pool.run(soak_job, name, args.calls, args.seconds, args.max_m, args.n, args.k,
                         args.min_m, args.slices, seed=1, timeout_s=args.seconds + 120)[0]
            if "skipped" in r:
                print(f"{name:>14}: skipped: {r['skipped']}")
                continue
            flat = r["scratch_after_warmup"] == r["scratch_final"]
            print(f"{name:>14}: {r['calls']} calls, {r['calls'] / r['seconds']:.0f} calls/s, "
                  f"{len(r['mismatches'])} mismatches, memory flat after warm-up: {flat} "
                  f"({r['scratch_final'][1]} B in {r['scratch_final'][0]} allocations)")
            for m in r["mismatches"][:5]:
                print(f"    mismatch: {m}")
            failed |= bool(r["mismatches"]) or not flat
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
