"""Time the mxfp4_w4a8 GEMM kernel's launch configs against the GPU's own GEMMs.

On a GPU, for one shape (default M x N x K = 8192 x 5120 x 4352: a prefill of one
rank's down_proj), every candidate config of ``radiance_ar/overlap/kernels/mxfp4_w4a8.py`` is
first checked against the float64 product of the dequantized operands (256 rows;
relative RMS error below 2^-8, else it is listed as WRONG and not timed), then timed:
the kernel alone on already quantized operands, median of CUDA-event times after
warm-up, the activation rotated over copies that exceed the L2 (tools/gpu_timing.py).
The same is measured for ``torch._scaled_mm`` fp8 rowwise (e4m3 both sides, per-token
and per-channel scales) and bf16 ``torch.mm``, and for the producer's ``prepare``
(per-token quantization; the op runs it once per call). The table (TFLOP/s = 2MNK / t)
is how the offline table ``CONFIGS`` is tuned: put a measured winner there and cite
the run.

Without a GPU, ``--compile-only --arch 90`` (or 100, or gfx950) compiles every
candidate for that target with the installed Triton and prints what the code would do:
shared memory, and for CUDA targets ptxas' registers, spills and whether it serialized
the wgmma pipeline (warning C7515).

    python tools/bench_mxfp4.py                                  # GPU
    python tools/bench_mxfp4.py --config 256,128,64,8,1,1,8,3,bf16 --json out.json
    python tools/bench_mxfp4.py --compile-only --arch 90        # no GPU needed
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

import gpu_timing
import metrics
from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap import producers
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


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def timed(fn, reps: int, warmup: int) -> float:
    return metrics.median_and_spread(gpu_timing.event_times(fn, reps, warmup))[0]


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
            ms = timed(lambda i: kernel.mxfp4_w4a8_gemm(xins[i % copies], xs, packed, scales,
                                                        out=out, config=cfg),
                       args.reps, args.warmup)
            row.update(ms=ms, tflops=tflops(m, n, k, ms))
        rows.append(row)
    x8s = [xq] + [xq.clone() for _ in range(copies - 1)]
    w8 = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(FP8)
    w8_scale = (w.float().abs().amax(1) / 448).reshape(1, -1)
    ms = timed(lambda i: torch._scaled_mm(x8s[i % copies], w8.t(), scale_a=xs[:, None],
                                          scale_b=w8_scale, out_dtype=BF16, out=out),
               args.reps, args.warmup)
    rows.append({"kernel": "torch._scaled_mm fp8 rowwise", "ms": ms, "tflops": tflops(m, n, k, ms)})
    xbs = [x] + [x.clone() for _ in range(copies - 1)]
    ms = timed(lambda i: torch.mm(xbs[i % copies], w.t(), out=out), args.reps, args.warmup)
    rows.append({"kernel": "torch.mm bf16", "ms": ms, "tflops": tflops(m, n, k, ms)})
    prod, scratch = producers.get(mx.NAME), ScratchPool()
    ms = timed(lambda i: prod.prepare(xbs[i % copies], packed, scales, scratch),
               args.reps, args.warmup)
    rows.append({"kernel": "producer prepare (quantize x)", "ms": ms})
    return rows


def compile_only(args: argparse.Namespace, candidates) -> list[dict]:
    """Compile each candidate for ``args.arch`` with the installed Triton (no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = kernel._kernel()
    hip = not args.arch.isdigit()
    target = GPUTarget("hip", args.arch, 64) if hip else GPUTarget("cuda", int(args.arch), 32)
    rows = []
    for cfg, x_dtype in candidates:
        sig = {"x_ptr": "*bf16" if x_dtype == BF16 else "*fp8e4nv", "xs_ptr": "*fp32",
               "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16", "rows": "i32", "N": "i32",
               "K": "i32", "x_row_stride": "i32", "w_row_stride": "i32",
               "ws_row_stride": "i32", "out_row_stride": "i32"}
        # As a launch specializes them: 16-divisible pointers, N, K and strides
        # (K / 32 = ws_row_stride is 8-divisible only at K = 4352; left unmarked).
        aligned = [i for i, a in enumerate(sig) if a not in ("rows", "ws_row_stride")]
        const = {"X_FORMAT": "bf16" if x_dtype == BF16 else "e4m3", "W_LHS": cfg.w_lhs,
                 "DEQUANT": cfg.dequant, "DOT_FP32": False, "EVEN_K": True,
                 "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                 "GROUP_M": cfg.group_m}
        sig.update({name: "constexpr" for name in const})
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const,
                                        attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
        row = {"kernel": label(cfg, x_dtype)}
        try:
            compiled = triton.compile(src, target=target, options={
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        except Exception as e:
            rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        row["shared_bytes"] = compiled.metadata.shared
        if not hip:
            row.update(_ptxas_report(compiled.asm["ptx"], int(args.arch)))
        rows.append(row)
    return rows


def _ptxas_report(ptx: str, arch: int) -> dict:
    """ptxas -v on Triton's PTX, with the ptxas Triton itself uses for ``arch``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", path,
                              "-o", path + ".cubin"], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "wgmma_serialized": "C7515" in res.stderr}


def print_table(rows: list[dict]) -> None:
    keys = [k for k in ("ms", "tflops", "rel_rms_err", "shared_bytes", "registers",
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
        rows = compile_only(args, candidates)
    else:
        print(f"# mxfp4_w4a8 GEMM {args.m} x {args.n} x {args.k} on "
              f"{torch.cuda.get_device_name()}, Triton {triton.__version__}, "
              f"median of {args.reps} after {args.warmup}", flush=True)
        rows = bench(args, candidates)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"m": args.m, "n": args.n, "k": args.k, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
