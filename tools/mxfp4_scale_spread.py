"""How often an MXFP4 weight's output channel spans more block scales than e4m3 holds.

The fp8 routes (radiance_ar/overlap/kernels/mxfp4_fp8_gemm.py) are exact for a channel
whose blocks holding a nonzero code lie within 15 binades of scale (spread <= 14); a
weight with a wider channel takes the bf16-widening kernel. No real checkpoint is at
hand here, so this quantizes (the OCP MX conversion of
radiance_ar/overlap/producer_mxfp4.quantize_weight) synthetic weights of the
distributions real LLM weights are described by -- Gaussian; heavy-tailed (Student t,
Laplace); a few "super weights" 10^3 or 10^4 times the rest; input channels scaled by a
log-normal factor (outlier features folded into the weight) -- and prints, per
distribution, the channel spread's median, 99.9th percentile and maximum and the
fraction of channels over 14. CPU, about a minute:

    python tools/mxfp4_scale_spread.py --rows 1024 --k 7168
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fk


def distributions(n: int, k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def gauss() -> torch.Tensor:
        return torch.randn(n, k, generator=g) / k ** 0.5

    out = {"gaussian": gauss(),
           "student-t nu=3": torch.distributions.StudentT(3.0).sample((n, k)) / k ** 0.5,
           "laplace": torch.distributions.Laplace(0.0, 1.0).sample((n, k)) / k ** 0.5}
    for factor in (1e3, 1e4):
        w = gauss()
        hits = torch.randint(0, n * k, (max(1, n * k // 100_000),), generator=g)
        w.view(-1)[hits] *= factor
        out[f"super weights x{factor:g} (1e-5 of them)"] = w
    for sigma in (1.0, 2.0):
        col = torch.exp(sigma * torch.randn(1, k, generator=g))
        out[f"input channels x lognormal(sigma={sigma:g})"] = gauss() * col
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024, help="output channels a distribution")
    p.add_argument("--k", type=int, default=7168, help="input channels, a multiple of 32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if args.rows < 1 or args.k < 32 or args.k % 32:
        p.error("--rows >= 1, --k a positive multiple of 32")
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    limit = fk.E_MAX - fk.E_MIN
    print(f"# channel scale spread (binades - 1) of MXFP4-quantized synthetic weights, "
          f"{args.rows} x {args.k}; e4m3 holds spread <= {limit}")
    print(f"{'distribution':<40} {'median':>6} {'p99.9':>6} {'max':>4} {'> ' + str(limit):>8}")
    rows = []
    for name, w in distributions(args.rows, args.k, g).items():
        packed, scales = mx.quantize_weight(w)
        _, spread = fk.column_range(packed, scales)
        s = spread.double()
        rows.append({"distribution": name, "median": float(s.median()),
                     "p99_9": float(s.quantile(0.999)), "max": int(spread.max()),
                     "over_limit": float((spread > limit).double().mean())})
        r = rows[-1]
        print(f"{name:<40} {r['median']:>6.0f} {r['p99_9']:>6.0f} {r['max']:>4} "
              f"{r['over_limit']:>8.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python tools/mxfp4_scale_spread.py " + " ".join(
                argv if argv is not None else sys.argv[1:]), "rows_per_distribution": args.rows,
                "k": args.k, "seed": args.seed, "limit": limit, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
