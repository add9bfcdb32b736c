"""Time the mxfp4_w4a8 GEMM kernel's launch configs against the GPU's own GEMMs.

On a GPU, for one shape (default M x N x K = 8192 x 5120 x 4352: a prefill of one
rank's down_proj), every candidate config of ``radiance_ar/overlap/kernels/mxfp4_w4a8.py`` is
first checked against the float64 product of the dequantized operands (256 rows;
relative RMS error below 2^-8, else it is listed as WRONG and not timed), then timed:
the kernel alone on already quantized operands, median of CUDA-event times after
warm-up, the activation rotated over copies that exceed the L2 (tools/gpu_timing.py).
The same is measured for ``torch._scaled_mm`` fp8 rowwise (e4m3 both sides, per-token
and per-channel scales) and bf16 ``torch.mm``, and for the producer's ``prepare``
(per-token quantization; the op runs it once per call), the one-pass quantize kernel
(same bits as the torch reference, checked) beside a device copy of its bytes, and the
fp8 route (the weight widened to e4m3, then ``torch._scaled_mm`` rowwise;
:mod:`radiance_ar.overlap.mxfp4_routes`) beside the Triton routes (fp8 and bf16 MMA).
Steps shorter than their launch (quantize, widen, prepare, the copy) also get
``graph_ms``: the device alone, launches replayed from a CUDA graph, as the op's replayed
calls run them (``ms`` is then the host's launch rate). ``--sweep`` times the three routes
over the prefill bench's o_proj and down_proj shapes at M = 256 .. 16384 (the fp8
route's row threshold). The table (TFLOP/s = 2MNK / t)
is how the offline table ``CONFIGS`` is tuned: put a measured winner there and cite
the run.

Without a GPU, ``--compile-only --arch 90`` (or 100, or gfx950) compiles every
candidate for that target with the installed Triton (on CUDA targets also the fp8
kernel's table configs) and prints what the code would do: shared memory, and for CUDA
targets ptxas' registers, spills and whether it serialized the wgmma pipeline (C7515).

    python tools/bench_mxfp4.py                                  # GPU
    python tools/bench_mxfp4.py --config 256,128,64,8,1,1,8,3,bf16 --json out.json
    python tools/bench_mxfp4.py --sweep --reps 20 --json sweep.json
    python tools/bench_mxfp4.py --compile-only --arch 90        # no GPU needed
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import gpu_timing
import metrics
import model_shapes
from mxfp4_compile import compile_only
from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap import producers
from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fp8_kernel
from radiance_ar.overlap.kernels import mxfp4_widen_fp8
from radiance_ar.overlap.kernels.quantize_fp8_rows import quantize_fp8_rows
from radiance_ar.overlap.kernels import mxfp4_w4a8 as kernel
from radiance_ar.overlap.scratch import ScratchPool

C = kernel.LaunchConfig
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
#: (config, activation storage): the table's entries for Hopper, neighbours of them, and
#: tl.dot_scaled emulated by Triton (the naive kernel) for comparison
CANDIDATES = [
    (C(128, 128, 128, 8, True, True, 8, 3), BF16),
    (C(128, 128, 64, 8, True, True, 8, 4), BF16),
    (C(256, 128, 64, 8, True, True, 8, 3), BF16),
    (C(128, 64, 128, 8, True, True, 4, 4), BF16),
    (C(128, 128, 128, 8, True, False, 8, 3), BF16),
    (C(128, 128, 128, 8, False, False, 8, 3), FP8),
]
CHECK_ROWS = 256
ERROR_BOUND = 2 ** -8  # bf16 output rounding is about 2^-9.5 relative RMS


def parse_config(text: str) -> tuple[kernel.LaunchConfig, torch.dtype]:
    """``BM,BN,BK,GROUP_M,W_LHS,DEQUANT,WARPS,STAGES,{bf16|fp8}``."""
    parts = text.split(",")
    if len(parts) != 9 or parts[8] not in ("bf16", "fp8"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BM,BN,BK,GROUP_M,W_LHS,DEQUANT,"
                                         "WARPS,STAGES,{bf16|fp8}")
    try:
        ints = [int(v) for v in parts[:8]]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the first 8 fields are integers") from None
    cfg = C(ints[0], ints[1], ints[2], ints[3], bool(ints[4]), bool(ints[5]), ints[6], ints[7])
    return cfg, BF16 if parts[8] == "bf16" else FP8


def label(cfg: kernel.LaunchConfig, x_dtype: torch.dtype) -> str:
    path = "dequant" if cfg.dequant else "dot_scaled"
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} "
            f"{'w_lhs' if cfg.w_lhs else 'x_lhs'} {path} w{cfg.num_warps} s{cfg.num_stages} "
            f"x:{'bf16' if x_dtype == BF16 else 'fp8'}")


def bench(args: argparse.Namespace, candidates) -> list[dict]:
    m, n, k = args.m, args.n, args.k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(BF16).cuda()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(BF16).cuda()
    packed, scales = mx.quantize_weight(w)
    xq, xs = mx.quantize_activation(x)
    ref = mx.reference(xq[:CHECK_ROWS], xs[:CHECK_ROWS], packed, scales)
    copies = gpu_timing.copies_for(x)
    out = torch.empty(m, n, dtype=BF16, device="cuda")
    rows = []
    for cfg, x_dtype in candidates:
        xin = xq.to(x_dtype)
        xins = [xin] + [xin.clone() for _ in range(copies - 1)]
        name = label(cfg, x_dtype)
        try:
            kernel.mxfp4_w4a8_gemm(xin[:CHECK_ROWS], xs[:CHECK_ROWS], packed, scales,
                                   out=out[:CHECK_ROWS], config=cfg)
        except Exception as e:  # a config this Triton cannot compile: listed, not fatal
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        err = float((out[:CHECK_ROWS].double() - ref).norm() / ref.norm())
        row = {"kernel": name, "rel_rms_err": err}
        if err <= ERROR_BOUND:
            ms = gpu_timing.median_ms(lambda i: kernel.mxfp4_w4a8_gemm(xins[i % copies], xs, packed, scales,
                                                        out=out, config=cfg),
                       args.reps, args.warmup)
            row.update(ms=ms, tflops=metrics.tflops(m, n, k, ms))
        rows.append(row)
    x8s = [xq] + [xq.clone() for _ in range(copies - 1)]
    w8 = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(FP8)
    w8_scale = (w.float().abs().amax(1) / 448).reshape(1, -1)
    ms = gpu_timing.median_ms(lambda i: torch._scaled_mm(x8s[i % copies], w8.t(), scale_a=xs[:, None],
                                          scale_b=w8_scale, out_dtype=BF16, out=out),
               args.reps, args.warmup)
    rows.append({"kernel": "torch._scaled_mm fp8 rowwise", "ms": ms, "tflops": metrics.tflops(m, n, k, ms)})
    xbs = [x] + [x.clone() for _ in range(copies - 1)]
    ms = gpu_timing.median_ms(lambda i: torch.mm(xbs[i % copies], w.t(), out=out), args.reps, args.warmup)
    rows.append({"kernel": "torch.mm bf16", "ms": ms, "tflops": metrics.tflops(m, n, k, ms)})
    q8 = torch.empty_like(xq)
    qs = torch.empty_like(xs)
    quantize_fp8_rows(x, out=q8, scale_out=qs)
    same = torch.equal(q8.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(qs, xs)
    x_bytes = 3 * m * k + 4 * m  # read bf16, write e4m3 and the scales
    rows.append(short_kernel_row(
        "quantize x: one-pass kernel", lambda i: quantize_fp8_rows(xbs[i % copies], out=q8,
                                                                   scale_out=qs),
        x_bytes, args, same_bits=same))
    rows.append(short_kernel_row(
        "quantize x: torch reference", lambda i: mx.quantize_activation(xbs[i % copies], out=q8),
        x_bytes, args))
    src = torch.empty(x_bytes // 2, dtype=torch.uint8, device="cuda")
    srcs, dst = [src] + [src.clone() for _ in range(gpu_timing.copies_for(src) - 1)], src.clone()
    rows.append(short_kernel_row("device copy of the quantizer's bytes",
                                 lambda i: dst.copy_(srcs[i % len(srcs)]), x_bytes, args))
    rows += route_rows(args, m, n, k, xq, xs, packed, scales,
                       fp8_kernel.plan_columns(packed, scales), copies)
    prod, scratch = producers.get(mx.NAME), ScratchPool()
    rows.append(short_kernel_row("producer prepare (quantize x, widen w on the fp8 route)",
                                 lambda i: prod.prepare(xbs[i % copies], packed, scales, scratch),
                                 None, args))
    return rows


def short_kernel_row(name: str, fn, nbytes: float | None, args: argparse.Namespace,
                     **extra) -> dict:
    """A row for a step shorter than its launch: ``ms`` from a stream of eager calls
    (host-bound where the launch outlasts the kernel), ``graph_ms`` the device alone
    (launches replayed from a CUDA graph), ``gb_per_s`` from ``graph_ms``."""
    ms = gpu_timing.median_ms(fn, args.reps, args.warmup)
    graph_ms = metrics.median_and_spread(gpu_timing.replayed_times(fn, args.reps))[0]
    row = {"kernel": name, "ms": ms, "graph_ms": graph_ms, **extra}
    if nbytes is not None:
        row["gb_per_s"] = nbytes / (graph_ms * 1e-3) / 1e9
    return row


def route_rows(args, m, n, k, xq, xs, packed, scales, plan, copies) -> list[dict]:
    """The three routes of the producer (radiance_ar/overlap/mxfp4_routes.py) on quantized
    x (``xq``, ``xs``) and the weight's column ``plan``, each checked on its first rows
    against float64, then timed: cublas_fp8 (widen + torch._scaled_mm rowwise, both timed),
    triton_fp8 and triton_bf16 (their table configs)."""
    if not plan.fits:
        return [{"kernel": f"fp8 routes: {plan.reason}", "error": "does not fit"}]
    ref = mx.reference(xq[:CHECK_ROWS], xs[:CHECK_ROWS], packed, scales)
    xqs = [xq] + [xq.clone() for _ in range(copies - 1)]
    w8 = torch.empty(n, k, dtype=FP8, device="cuda")
    out = torch.empty(m, n, dtype=BF16, device="cuda")
    col_scale = plan.col_scale.reshape(1, -1)

    def cublas_fp8(i: int) -> None:
        mxfp4_widen_fp8.widen(packed, scales, plan.top, out=w8)
        torch._scaled_mm(xqs[i % copies], w8.t(), scale_a=xs[:, None], scale_b=col_scale,
                         out_dtype=BF16, out=out)

    xin = xq.to(kernel.activation_dtype(xq.device))
    xins = [xin] + [xin.clone() for _ in range(copies - 1)]
    arms = [("route cublas_fp8: widen w + _scaled_mm rowwise", cublas_fp8),
            ("route triton_fp8: table config",
             lambda i: fp8_kernel.mxfp4_fp8_gemm(xqs[i % copies], xs, packed, scales, plan,
                                                 out=out)),
            (f"route triton_bf16: table config ({kernel.row_class(m)})",
             lambda i: kernel.mxfp4_w4a8_gemm(xins[i % copies], xs, packed, scales, out=out))]
    rows = []
    for name, fn in arms:
        out.fill_(float("nan"))
        try:
            fn(0)
        except Exception as e:  # a route this Triton cannot compile: listed, and a failure
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        err = float((out[:CHECK_ROWS].double() - ref).norm() / ref.norm())
        ms = gpu_timing.median_ms(fn, args.reps, args.warmup)
        rows.append({"kernel": name, "ms": ms, "tflops": metrics.tflops(m, n, k, ms),
                     "rel_rms_err": err})
    rows.append(short_kernel_row("route cublas_fp8: widen w alone",
                                 lambda i: mxfp4_widen_fp8.widen(packed, scales, plan.top, out=w8),
                                 n * k * 1.5 + n * k / 32, args))
    return rows


SWEEP_ROWS = (256, 1024, 2048, 4096, 8192, 16384)


def sweep(args: argparse.Namespace) -> list[dict]:
    """The three routes and torch's fp8 rowwise GEMM at every sweep shape and M."""
    rows = []
    for model, layer, n, k in model_shapes.row_parallel_shapes():
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(BF16).cuda()
        packed, scales = mx.quantize_weight(w)
        plan = fp8_kernel.plan_columns(packed, scales)
        w8 = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(FP8)
        w8_scale = (w.float().abs().amax(1) / 448).reshape(1, -1)
        for m in args.sweep_rows:
            x = torch.randn(m, k, generator=g).to(BF16).cuda()
            copies = gpu_timing.copies_for(x)
            xq, xs = quantize_fp8_rows(x)
            x8s = [xq] + [xq.clone() for _ in range(copies - 1)]
            out = torch.empty(m, n, dtype=BF16, device="cuda")
            ms = gpu_timing.median_ms(lambda i: torch._scaled_mm(x8s[i % copies], w8.t(), scale_a=xs[:, None],
                                                  scale_b=w8_scale, out_dtype=BF16, out=out),
                       args.reps, args.warmup)
            base = {"model": model, "layer": layer, "m": m, "n": n, "k": k}
            rows.append(dict(base, kernel="torch._scaled_mm fp8 rowwise", ms=ms,
                             tflops=metrics.tflops(m, n, k, ms)))
            for r in route_rows(args, m, n, k, xq, xs, packed, scales, plan, copies):
                rows.append(dict(base, **r))
            del x8s
    return rows


def print_table(rows: list[dict]) -> None:
    keys = [k for k in ("m", "n", "k", "ms", "graph_ms", "tflops", "gb_per_s", "rel_rms_err", "same_bits",
                        "shared_bytes", "registers",
                        "spill_bytes", "wgmma_serialized") if any(k in r for r in rows)]
    width = max(len(r["kernel"]) for r in rows)
    print(f"{'kernel':<{width}}  " + "  ".join(f"{k:>16}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append(f"{'-' if v is None else f'{v:.4g}' if isinstance(v, float) else v!s:>16}")
        extra = f"  {r['error']}" if "error" in r else (
            "  WRONG: not timed" if "rel_rms_err" in r and "ms" not in r else "")
        print(f"{r['kernel']:<{width}}  " + "  ".join(f"{c:>16}" for c in cells) + extra)


#: the sweep table's columns: (heading, row label prefix)
SWEEP_COLUMNS = (("fp8 rowwise", "torch._scaled_mm"), ("cublas_fp8", "route cublas_fp8: widen w +"),
                 ("widen", "route cublas_fp8: widen w alone"), ("triton_fp8", "route triton_fp8"),
                 ("triton_bf16", "route triton_bf16"))


def print_sweep(rows: list[dict]) -> None:
    """One line per shape and M: ms of torch's fp8 rowwise GEMM and of each route, and the
    best route's ratio to fp8 rowwise."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (r["model"], r["layer"], r["m"], r["n"], r["k"])
        for head, prefix in SWEEP_COLUMNS:
            if r["kernel"].startswith(prefix) and "ms" in r:
                cells.setdefault(key, {})[head] = r["ms"]
    heads = [h for h, _ in SWEEP_COLUMNS]
    print(f"{'model':<18} {'layer':<9} {'m':>6} {'n':>5} {'k':>5}  "
          + "  ".join(f"{h:>11}" for h in heads) + "  best/fp8")
    for key, ms in cells.items():
        routes = [ms[h] for h in ("cublas_fp8", "triton_fp8", "triton_bf16") if h in ms]
        ratio = min(routes) / ms["fp8 rowwise"] if routes and "fp8 rowwise" in ms else float("nan")
        print(f"{key[0]:<18} {key[1]:<9} {key[2]:>6} {key[3]:>5} {key[4]:>5}  "
              + "  ".join(f"{ms.get(h, float('nan')):>11.4f}" for h in heads) + f"  {ratio:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=8192, help="rows (tokens)")
    p.add_argument("--n", type=int, default=5120, help="output channels")
    p.add_argument("--k", type=int, default=4352, help="input channels, a multiple of 32")
    p.add_argument("--reps", type=int, default=50, help="timed repeats (median reported)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before timing")
    p.add_argument("--config", type=parse_config, action="append", default=None,
                   help="a candidate BM,BN,BK,GROUP_M,W_LHS,DEQUANT,WARPS,STAGES,{bf16|fp8} "
                        "(repeatable); default: the built-in candidates")
    p.add_argument("--compile-only", action="store_true",
                   help="compile for --arch with the installed Triton; no GPU needed")
    p.add_argument("--arch", default="90", help="--compile-only target: 90, 100 or gfx950")
    p.add_argument("--sweep", action="store_true",
                   help="instead: the three routes and fp8 rowwise at the o_proj/down_proj shapes "
                        "of the prefill bench's models, M = 256 .. 16384")
    p.add_argument("--sweep-rows", type=lambda t: [int(v) for v in t.split(",")],
                   default=list(SWEEP_ROWS), help="--sweep's M values, comma-separated")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if min(args.m, args.n, args.k, args.reps) < 1 or args.k % kernel.MX_GROUP:
        p.error("--m, --n, --k, --reps must be >= 1 and --k a multiple of 32")
    candidates = args.config or CANDIDATES
    if not args.compile_only and not torch.cuda.is_available():
        p.error("timing needs a CUDA/ROCm GPU; without one, use --compile-only")
    import triton

    if args.compile_only:
        print(f"# mxfp4_w4a8 configs compiled for {args.arch}, Triton {triton.__version__}")
        rows = compile_only(args.arch, candidates, label)
    elif args.sweep:
        print(f"# mxfp4_w4a8 routes over the prefill shapes on {torch.cuda.get_device_name()}, "
              f"Triton {triton.__version__}, median of {args.reps} after {args.warmup}", flush=True)
        rows = sweep(args)
    else:
        print(f"# mxfp4_w4a8 GEMM {args.m} x {args.n} x {args.k} on "
              f"{torch.cuda.get_device_name()}, Triton {triton.__version__}, "
              f"median of {args.reps} after {args.warmup}", flush=True)
        rows = bench(args, candidates)
    if args.sweep:
        print_sweep(rows)
    else:
        print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"m": args.m, "n": args.n, "k": args.k, "rows": rows}, f, indent=1)
    failed = [r["kernel"] for r in rows if r.get("same_bits") is False
              or (r["kernel"].startswith("route ") and "error" in r)
              or (r["kernel"].startswith("route ") and "tflops" in r
                  and not r.get("rel_rms_err", 0.0) <= ERROR_BOUND)]
    if failed:
        print(f"FAILED: {', '.join(failed)} (different bits from the reference quantizer, or a "
              f"route's error above {ERROR_BOUND:.3g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
