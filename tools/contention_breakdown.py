#!/usr/bin/env python3
"""Which part of an all-reduce slows a concurrent GEMM? One GPU, emulated ranks.

    python tools/contention_breakdown.py --world 4 --m 8192

Times a bf16 GEMM alone and while each of these runs back to back on another stream:
a D2H copy and an H2D copy of the slice (copy engines), the Triton fp32 reduce of W
device inputs, and each backend's whole all-reduce (one active rank, passive peers).
A part with ratio ~1.00 takes nothing from the GEMM; the first part above it is where
the contention of the whole comes from.
"""

from __future__ import annotations

import argparse
import sys

import torch


from radiance_ar import backends  # noqa: E402
import gpu_timing  # noqa: E402
from radiance_ar import envs  # noqa: E402
from radiance_ar.overlap.plan import input_view  # noqa: E402
from radiance_ar.transport.copy_engine import CopyEngine  # noqa: E402
from radiance_ar.transport.world import emulated_worlds  # noqa: E402

envs.prepare_cuda_for_emulated_ranks()  # importing torch does not start CUDA; main() does


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="emulated ranks (default 4)")
    p.add_argument("--m", type=int, default=8192, help="rows (default 8192)")
    p.add_argument("--n", type=int, default=5120, help="columns (default 5120)")
    p.add_argument("--k", type=int, default=4352, help="GEMM inner dimension (default 4352)")
    p.add_argument("--backends", default="sdma", help="comma-separated backends (default sdma)")
    p.add_argument("--reps", type=int, default=20, help="timed repeats (default 20)")
    args = p.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(args.m, args.k, device=dev).to(torch.bfloat16)
    w = torch.randn(args.n, args.k, device=dev).to(torch.bfloat16)
    y = torch.empty(args.m, args.n, device=dev, dtype=torch.bfloat16)
    slice_dev = torch.randn_like(y)
    slice_host = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    inputs = [torch.randn_like(y) for _ in range(args.world)]
    engine = CopyEngine(dev)

    def gemm(i):
        torch.mm(x, w.t(), out=y)

    def d2h(i):
        engine.copy(slice_host, slice_dev, torch.cuda.current_stream().cuda_stream)

    def h2d(i):
        engine.copy(slice_dev, slice_host, torch.cuda.current_stream().cuda_stream)

    def reduce(i):
        from radiance_ar.backends.kernels.reduce_sum import reduce_sum

        reduce_sum(inputs, slice_dev)

    parts = [("D2H copy", d2h), ("H2D copy", h2d), (f"reduce of {args.world}", reduce)]
    for name in args.backends.split(","):
        world = emulated_worlds(args.world, dev)[0]
        ar = backends.get(name)(world)
        ar.ensure_capacity(args.m, args.n, torch.bfloat16)
        ar.fill_passive_peers()
        ar_in = input_view(ar, args.m, args.n, torch.bfloat16, lambda: slice_dev)
        parts.append((f"{name} all-reduce", lambda i, ar=ar, ar_in=ar_in: ar.all_reduce(ar_in, y)))
    t_gemm = gpu_timing.median_ms(gemm, args.reps, 3)
    print(f"1 GPU, {args.world} emulated ranks; GEMM {args.m}x{args.k}x{args.n} "
          f"{t_gemm:.3f} ms back to back; contention as compare_backends measures it (the "
          "GEMM gated alone against the same beside the part, started at spread phases)")
    for name, fn in parts:
        t_part = gpu_timing.median_ms(fn, 5, 2)
        rec = gpu_timing.contention_record(
            gpu_timing.contention_times(gemm, fn, t_gemm, t_part, args.reps, 3))
        print(f"{name:>22}: {t_part:7.3f} ms alone; GEMM beside it "
              f"{rec['t_gemm_concurrent_ms']:.3f} ms against {rec['t_gemm_gated_ms']:.3f} "
              f"({rec['contention']:.2f}x ±{rec['contention_spread']:.2f}, worst phase "
              f"{rec['contention_max']:.2f}x, {rec['contention_reps']} phases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
