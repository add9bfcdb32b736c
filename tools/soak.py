#!/usr/bin/env python3
"""Soak the op: many calls with random M, every result checked, memory watched.

    python tools/soak.py --world 2 --calls 2000 --backends stock          # CPU processes
    python tools/soak.py --device cuda --world 2 --calls 5000 --max-m 16384 --n 1024

Each call draws M in [1, --max-m] from one seeded sequence (every rank draws the same),
compares every rank's output with a float64 reference (the sum of every rank's float64
partial product) within the backend's error bound, and checks the bits are identical
on every rank. ``--warmup`` calls run first, the first of them at M = --max-m (the
high-water mark: persistent buffers stop growing there); then the memory state is
taken, and again after the last call. It must not move: the op's scratch pool and the
peer-visible memory (allocations and bytes) and, on a GPU, ``torch.cuda.memory_reserved``
and ``memory_allocated``. Prints calls/s, mismatches and whether memory stayed flat;
exit status 1 on any mismatch or growth.

Worlds: ``--device cpu`` (default) starts W gloo processes, M below --min-m takes the
decode path; ``--device cuda`` drives W emulated ranks on one GPU, each on its own stream
(peer buffers in pinned host memory: docs/design.md, 'Worlds'), and every call is
sliced: there is no vendor collective between emulated ranks for the decode path.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist


from radiance_ar import backends  # noqa: E402
import metrics  # noqa: E402
from world_measure import digest  # noqa: E402
from radiance_ar import overlap  # noqa: E402
from radiance_ar import envs  # noqa: E402
from radiance_ar.overlap.config import OverlapSettings  # noqa: E402
from radiance_ar.overlap.op import forward  # noqa: E402

envs.prepare_cuda_for_emulated_ranks()  # importing torch does not start CUDA; main() does


def memory_state(rts: list, device: torch.device) -> tuple[int, ...]:
    """(allocations, bytes) of the op's scratch pools and peer memory of ``rts``, and on a
    GPU the caching allocator's reserved and allocated bytes."""
    state = (sum(rt.scratch.growths + rt.world.memory.allocations for rt in rts),
             sum(rt.scratch.reserved_bytes() + rt.world.memory.allocated_bytes for rt in rts))
    if device.type == "cuda":
        state += (torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
    return state


def soak_loop(step: Callable[[int], tuple[float, bool]], memory: Callable[[], tuple],
              stop_everywhere: Callable[[bool], bool], bound: float, calls: int, warmup: int,
              seconds: float, max_m: int, seed: int) -> dict:
    """``warmup`` calls (the first at ``max_m``), then up to ``calls`` checked calls or
    ``seconds``; ``step(rows)`` runs one call on every rank this process drives and returns
    (worst relative RMS error, identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)  # same M sequence on every rank
    draw = lambda: int(torch.randint(1, max_m + 1, (1,), generator=gen))  # noqa: E731
    mismatches, done = [], 0
    for i in range(warmup):
        rows = max_m if i == 0 else draw()
        rel, same = step(rows)
        if not rel <= bound or not same:  # NaN fails
            mismatches.append({"call": f"warm-up {i}", "M": rows, "rel_rms_err": rel,
                               "identical_on_ranks": same})
    warm = memory()
    t0 = time.perf_counter()
    while done < calls:
        rows = draw()
        rel, same = step(rows)
        if not rel <= bound or not same:
            mismatches.append({"call": done, "M": rows, "rel_rms_err": rel,
                               "identical_on_ranks": same})
        done += 1
        if stop_everywhere(time.perf_counter() - t0 > seconds):
            break
    return {"calls": done, "seconds": time.perf_counter() - t0, "mismatches": mismatches,
            "memory_after_warmup": warm, "memory_final": memory()}


def soak_job(world, backend: str, calls: int, seconds: float, max_m: int, cols: int, k: int,
             min_m: int, slices: int, seed: int, warmup: int = 50) -> dict:
    """Collective, one rank of a CPU world. Rank 0 decides when ``seconds`` are up."""
    reason = backends.get(backend).unsupported_reason(world)
    if reason is not None:
        return {"backend": backend, "skipped": reason}
    rt = overlap.build(world, OverlapSettings(True, backend, min_m, slices,
                                              envs.BackendSettings.from_env()))
    wgen = torch.Generator().manual_seed(seed * 31 + world.rank)
    w = (torch.randn(cols, k, generator=wgen) / k ** 0.5).to(torch.bfloat16)
    x_all = torch.randn(max_m, k, generator=wgen).to(torch.bfloat16)

    def step(rows: int) -> tuple[float, bool]:
        x = x_all[:rows]
        out = forward(rt, x, w, None, "bf16")
        ref = x.double() @ w.double().t()
        dist.all_reduce(ref, group=world.group)
        rel, _ = metrics.errors(out, ref)
        # the worst rank's error, and the same bits on every rank (a CRC-32 of the bytes: a
        # sum of the values would take two swapped elements for equal)
        worst = torch.tensor([rel], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=world.group)
        crc = torch.tensor([float(digest(out))], dtype=torch.float64)
        lo, hi = crc.clone(), crc.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=world.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=world.group)
        return worst.item(), lo.item() == hi.item()

    def stop_everywhere(mine: bool) -> bool:
        flag = torch.full((1,), float(mine))
        dist.broadcast(flag, src=dist.get_global_rank(world.group, 0), group=world.group)
        return bool(flag.item())

    res = soak_loop(step, lambda: memory_state([rt], world.device), stop_everywhere,
                    rt.backend.rel_rms_bound, calls, warmup, seconds, max_m, seed)
    rt.close()
    return {"backend": backend, **res}


def emulated_soak(backend: str, size: int, device: torch.device, calls: int, seconds: float,
                  max_m: int, cols: int, k: int, slices: int, seed: int,
                  warmup: int = 50) -> dict:
    """W emulated ranks on one GPU in this process (see the module doc)."""
    from radiance_ar.harness.emulated import EmulatedRanks

    ranks = EmulatedRanks(size, device)
    worlds = ranks.worlds
    reason = backends.get(backend).unsupported_reason(worlds[0])
    if reason is not None:
        return {"backend": backend, "skipped": reason}
    settings = OverlapSettings(True, backend, 1, slices, envs.BackendSettings.from_env())
    rts = [overlap.build(w, settings) for w in worlds]
    data = []
    for rank in range(size):
        g = torch.Generator().manual_seed(seed * 31 + rank)
        w = (torch.randn(cols, k, generator=g) / k ** 0.5).to(torch.bfloat16)
        data.append((torch.randn(max_m, k, generator=g).to(torch.bfloat16).to(device),
                     w.to(device)))
    # The check's operands and results, made once: per-call temporaries of M x N would move
    # the caching allocator's reserved bytes that the soak watches.
    data64 = [(x.double(), w.double().t()) for x, w in data]
    ref_all = torch.empty(max_m, cols, dtype=torch.float64, device=device)
    work_all = torch.empty_like(ref_all)
    equal_all = torch.empty(max_m, cols, dtype=torch.bool, device=device)
    ranks.prepare(lambda r: rts[r].backend.ensure_capacity(max_m, cols, torch.bfloat16))

    def step(rows: int) -> tuple[float, bool]:
        # Each rank's stream waits for the caller first: that also orders this call's
        # allocations after the last check.
        outs = []
        for r, (x, w) in enumerate(data):
            with ranks.on(r):
                outs.append(forward(rts[r], x[:rows], w, None, "bf16"))
        for rt in rts:
            rt.backend.check()  # bounded: a missing peer raises instead of hanging
        ranks.join()
        ref, part = ref_all[:rows], work_all[:rows]
        torch.mm(data64[0][0][:rows], data64[0][1], out=ref)
        for x64, wt64 in data64[1:]:
            # mm then add, not addmm_: addmm_ takes the cuBLASLt path for some shapes, whose
            # first use allocates a workspace for good, at whatever late call first draws
            # such a shape (docs/history.md).
            ref.add_(torch.mm(x64[:rows], wt64, out=part))
        rels = [metrics.errors(o, ref, part)[0] for o in outs]
        rel = max(rels) if all(r == r for r in rels) else math.nan  # max() can drop a NaN
        # torch.eq into a buffer, not torch.equal: its M x N temporary can take a new segment
        # of the allocator's pool at a late call (docs/history.md). On the bits (int16
        # views): a value compare takes -0 for +0 and never one NaN for another
        same = all(bool(torch.eq(o.view(torch.int16), outs[0].view(torch.int16),
                                 out=equal_all[:rows]).all()) for o in outs[1:])
        return rel, same

    res = soak_loop(step, lambda: memory_state(rts, device), lambda mine: mine,
                    rts[0].backend.rel_rms_bound, calls, warmup, seconds, max_m, seed)
    for rt in rts:
        rt.close()
    return {"backend": backend, **res}


def report(r: dict, device: torch.device) -> bool:
    """Print one backend's line; True if it failed (a mismatch or memory that moved)."""
    name = r["backend"]
    if "skipped" in r:
        print(f"{name:>14}: skipped: {r['skipped']}")
        return False
    warm, final = r["memory_after_warmup"], r["memory_final"]
    flat = warm == final
    gpu = (f", cuda reserved {final[2] / 2**20:.1f} MiB, allocated {final[3] / 2**20:.1f} MiB"
           if device.type == "cuda" else "")
    print(f"{name:>14}: {r['calls']} calls, {r['calls'] / r['seconds']:.0f} calls/s, "
          f"{len(r['mismatches'])} mismatches, memory flat after warm-up: {flat} "
          f"(scratch + peer: {final[1]} B in {final[0]} allocations{gpu})")
    if not flat:
        print(f"    memory after warm-up {warm}, at the end {final}")
    for m in r["mismatches"][:5]:
        print(f"    mismatch: {m}")
    return bool(r["mismatches"]) or not flat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: W gloo processes; cuda: W emulated ranks on GPU 0")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--backends", default=None, help="comma-separated; default every registered one")
    p.add_argument("--calls", type=int, default=2000, help="checked calls per backend after "
                   "the warm-up (default 2000)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up calls (default 50)")
    p.add_argument("--seconds", type=float, default=600.0, help="stop a backend after this long")
    p.add_argument("--max-m", type=int, default=96, help="largest M drawn (default 96)")
    p.add_argument("--min-m", type=int, default=32,
                   help="RADIANCE_AR_OVERLAP_MIN_M, CPU only (default 32: both paths run)")
    p.add_argument("--slices", type=int, default=3, help="slices of the pipeline (default 3)")
    p.add_argument("--n", type=int, default=256,
                   help="output columns (default 256: one block of the wht6 codec)")
    p.add_argument("--k", type=int, default=32, help="input columns (default 32)")
    args = p.parse_args(argv)
    if min(args.world, args.calls, args.warmup, args.max_m, args.min_m, args.slices, args.n,
           args.k) < 1 or not args.seconds > 0:
        p.error("--world, --calls, --warmup, --max-m, --min-m, --slices, --n and --k must be "
                ">= 1 and --seconds > 0")
    names = backends.names() if args.backends is None else args.backends.split(",")
    for name in names:
        try:
            backends.get(name)
        except ValueError as e:  # an unknown name, with the registered ones
            p.error(str(e))
    failed = False
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA/ROCm device is visible")
        device = torch.device("cuda", 0)
        print(f"soak: 1 GPU ({torch.cuda.get_device_name(device)}), {args.world} emulated "
              f"ranks over PCIe, M in 1..{args.max_m}, N = {args.n}, K = {args.k}, "
              f"{args.slices} slices")
        for name in names:
            failed |= report(emulated_soak(name, args.world, device, args.calls, args.seconds,
                                           args.max_m, args.n, args.k, args.slices, seed=1,
                                           warmup=args.warmup), device)
        return 1 if failed else 0
    from radiance_ar.harness.cpu_world import CpuWorldPool

    print(f"soak: CPU, {args.world} processes (gloo + shared memory), M in 1..{args.max_m}, "
          f"MIN_M = {args.min_m}, N = {args.n}, K = {args.k}, {args.slices} slices")
    with CpuWorldPool(args.world) as pool:
        for name in names:
            r = pool.run(soak_job, name, args.calls, args.seconds, args.max_m, args.n, args.k,
                         args.min_m, args.slices, seed=1, warmup=args.warmup,
                         timeout_s=args.seconds + 120)[0]
            failed |= report(r, torch.device("cpu"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
