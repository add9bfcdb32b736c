"""Benchmark the wht6 codec against the QuickReduce-style INT6 baseline.

Accuracy: for each distribution and world size W, W ranks' bf16 inputs are encoded
independently, summed (wht6: decode_accumulate; INT6: dequantize, fp32 sum) and rounded
once to bf16; the result is compared with the float64 sum of the same bf16 inputs
(relative RMS error). "bf16 floor" is the error of rounding that exact sum to bf16, the
least any bf16 all-reduce can do. On a CPU the codec runs its torch reference; on a GPU
(--device cuda) its Triton kernels.

Throughput (GPU only): encode and decode_accumulate on an 8192 x 5120 bf16 tensor
(80 MiB), timed with CUDA events (median after warm-up, inputs and outputs rotated over
enough buffers to exceed the L2 cache), as GB/s of bytes read + written and as a
fraction of the device-to-device copy bandwidth measured the same way.

    python tools/bench_codec.py --quick            # CPU, under a minute
    python tools/bench_codec.py --device cuda --json out.json
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from backends import wht6  # noqa: E402
from backends.wht6 import baseline_int6  # noqa: E402

DISTS = ("gaussian", "student_t3", "outlier_channels", "outlier_tokens")


def make_inputs(dist: str, world: int, rows: int, cols: int, seed: int) -> list:
    """W ranks' partial sums (bf16, CPU). Outlier channels/tokens are the same on every
    rank: they are a property of the model and the prompt, not of the rank."""
    g = torch.Generator().manual_seed(seed)
    channels = torch.randperm(cols, generator=g)[: max(1, cols // 200)]  # 0.5% of channels
    tokens = torch.randperm(rows, generator=g)[: max(1, rows // 256)]  # a few rows
    ranks = []
    for _ in range(world):
        x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        if dist == "student_t3":
            chi2 = torch.randn(rows, cols, 3, generator=g, dtype=torch.float64).square().sum(-1)
            x = x / torch.sqrt(chi2 / 3)
        elif dist == "outlier_channels":
            x[:, channels] *= 30.0
        elif dist == "outlier_tokens":
            x[tokens] *= 50.0
        elif dist != "gaussian":
            raise ValueError(f"unknown distribution {dist!r}; choose from {DISTS}")
        ranks.append(x.to(torch.bfloat16))
    return ranks


def rel_rms(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def accuracy(dist: str, world: int, rows: int, cols: int, seed: int, device: str) -> dict:
    ranks = make_inputs(dist, world, rows, cols, seed)
    exact = torch.stack([x.double() for x in ranks]).sum(0)
    payloads = [wht6.encode(x.to(device)) for x in ranks]
    summed = wht6.decode_accumulate(payloads, (rows, cols), torch.bfloat16).cpu()
    int6 = baseline_int6.decode_sum([baseline_int6.quantize(x) for x in ranks], torch.bfloat16)
    err_wht6, err_int6 = rel_rms(summed, exact), rel_rms(int6, exact)
    return {"dist": dist, "world": world, "wht6": err_wht6, "int6": err_int6,
            "ratio": err_wht6 / err_int6, "bf16_floor": rel_rms(exact.to(torch.bfloat16), exact)}


def time_ms(fn, n_rotate: int, iters: int, warmup: int) -> float:
    """Median time of fn(i) over iters calls, i cycling over n_rotate buffer sets."""
    for i in range(warmup):
        fn(i % n_rotate)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    # Keep the GPU busy while the CPU queues every timed call, so the events time the
    # kernels and not Python launch overhead.
    torch.cuda._sleep(100_000_000)
    for i in range(iters):
        starts[i].record()
        fn(i % n_rotate)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def throughput(worlds: list, iters: int, warmup: int) -> list:
    rows, cols = 8192, 5120
    dev = torch.device("cuda")
    nbytes = rows * cols * 2
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20)
    n_rot = max(2, math.ceil(4 * l2 / nbytes) + 1)  # each call touches cold memory
    xs = [torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(n_rot)]
    outs = [torch.empty_like(x) for x in xs]
    # Enough payloads that consecutive decode_accumulate calls read disjoint sets.
    n_pay = 2 * max(worlds) + 2
    pays = [wht6.encode(xs[i % n_rot]) for i in range(n_pay)]
    pay_bytes = pays[0].numel()
    results = []

    copy_ms = time_ms(lambda i: outs[i].copy_(xs[(i + 1) % n_rot]), n_rot, iters, warmup)
    copy_gbs = 2 * nbytes / copy_ms / 1e6
    results.append({"kernel": "copy_ (D2D)", "bytes": 2 * nbytes, "ms": copy_ms, "GB/s": copy_gbs})
    ms = time_ms(lambda i: wht6.encode(xs[i % n_rot], out=pays[i]), n_pay, iters, warmup)
    results.append({"kernel": "encode", "bytes": nbytes + pay_bytes, "ms": ms})
    for w in worlds:
        ms = time_ms(lambda i: wht6.decode_accumulate(
            [pays[(i * w + k) % n_pay] for k in range(w)], (rows, cols), torch.bfloat16, out=outs[i % n_rot]),
            n_pay, iters, warmup)
        results.append({"kernel": f"decode_accumulate W={w}", "bytes": w * pay_bytes + nbytes, "ms": ms})
    for r in results[1:]:
        r["GB/s"] = r["bytes"] / r["ms"] / 1e6
    for r in results:
        r["of_copy"] = r["GB/s"] / copy_gbs
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024, help="rows of each accuracy tensor (default 1024)")
    p.add_argument("--cols", type=int, default=5120, help="columns, a multiple of 256 (default 5120)")
    p.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes W (default 2,4,8)")
    p.add_argument("--dists", default=",".join(DISTS), help=f"comma-separated distributions from {DISTS}")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the codec runs for the accuracy table: cpu = torch reference, "
                        "cuda = Triton kernels (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--quick", action="store_true", help="128 rows and 10 timing iterations: a smoke run")
    p.add_argument("--no-throughput", action="store_true", help="skip the GPU throughput table")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per kernel (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed warm-up iterations (default 10)")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON to PATH")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.rows, args.iters = min(args.rows, 128), min(args.iters, 10)
    worlds = [int(w) for w in args.worlds.split(",")]
    dists = args.dists.split(",")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA/ROCm device visible to torch")
    print(f"wht6 vs INT6 | codec on {args.device} | {args.rows}x{args.cols} bf16 per rank | "
          f"bits/value: wht6 {wht6.bits_per_value(args.cols):.3f}, int6 {baseline_int6.bits_per_value():.3f}")
    print(f"{'distribution':18s} {'W':>2s} {'wht6 err':>10s} {'int6 err':>10s} {'ratio':>6s} {'bf16 floor':>10s}")
    rows_out = []
    for dist in dists:
        for w in worlds:
            r = accuracy(dist, w, args.rows, args.cols, args.seed, args.device)
            rows_out.append(r)
            print(f"{dist:18s} {w:2d} {r['wht6']:10.5f} {r['int6']:10.5f} {r['ratio']:6.3f} {r['bf16_floor']:10.5f}")
    report = {"rows": args.rows, "cols": args.cols, "device": args.device,
              "bits_per_value": {"wht6": wht6.bits_per_value(args.cols), "int6": baseline_int6.bits_per_value()},
              "accuracy": rows_out, "throughput": None}
    if not args.no_throughput:
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            print(f"\nthroughput on {name}, 8192x5120 bf16 (80 MiB), median of {args.iters}")
            print(f"{'kernel':24s} {'MB moved':>9s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}")
            report["throughput"] = throughput(worlds, args.iters, args.warmup)
            report["device_name"] = name
            for r in report["throughput"]:
                print(f"{r['kernel']:24s} {r['bytes'] / 1e6:9.1f} {r['ms']:8.4f} {r['GB/s']:8.1f} {r['of_copy']:8.2f}")
        else:
            print("\nthroughput: skipped (no GPU)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
