"""Do a D2H and an H2D copy on two streams run at the same time (a full-duplex host link)?

The emulated world's publish lane (:mod:`radiance_ar.transport.side_lanes`) assumes that a rank's
D2H publish and its H2D pulls, on two streams, overlap. They do not when the two
streams feed one hardware queue (streams beyond ``CUDA_DEVICE_MAX_CONNECTIONS`` share
queues, and the legacy default stream may share one with a pool stream), or when the
runtime puts both directions on one copy engine. This times, with pinned host memory:

- each copy alone, then both started together, for three stream pairs: the legacy
  default stream with a pool stream, both ways (the compare tool's caller runs on the
  legacy default stream), and two pool streams.

``overlap`` = (D2H alone + H2D alone) / both together: 2.0 is full duplex, 1.0 is serial.

    python -m radiance_ar.diagnostics.duplex_check --mib 20
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def _time_ms(fn, streams: list[torch.cuda.Stream], reps: int) -> float:
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
        start.record(streams[0])
        for s in streams[1:]:
            s.wait_event(start)
        fn()
        for e, s in zip(ends, streams):
            e.record(s)
        torch.cuda.synchronize()
        samples.append(max(start.elapsed_time(e) for e in ends))
    return statistics.median(samples)


def check_pair(d2h_stream: torch.cuda.Stream, h2d_stream: torch.cuda.Stream, nbytes: int,
               reps: int) -> dict:
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def d2h():
        with torch.cuda.stream(d2h_stream):
            host_dst.copy_(dev_src, non_blocking=True)

    def h2d():
        with torch.cuda.stream(h2d_stream):
            dev_dst.copy_(host_src, non_blocking=True)

    def both():
        d2h()
        h2d()

    alone_d2h = _time_ms(d2h, [d2h_stream], reps)
    alone_h2d = _time_ms(h2d, [h2d_stream], reps)
    together = _time_ms(both, [d2h_stream, h2d_stream], reps)
    return {"d2h_ms": alone_d2h, "h2d_ms": alone_h2d, "both_ms": together,
            "overlap": (alone_d2h + alone_h2d) / together,
            "d2h_gbs": nbytes / alone_d2h / 1e6, "h2d_gbs": nbytes / alone_h2d / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=20, help="bytes per copy, MiB (default 20)")
    p.add_argument("--reps", type=int, default=20, help="timed repeats (default 20)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("duplex_check: needs a CUDA/ROCm device", file=sys.stderr)
        return 2
    nbytes = args.mib << 20
    pairs = {
        "default (legacy) + pool": (torch.cuda.default_stream(), torch.cuda.Stream()),
        "pool + default (legacy)": (torch.cuda.Stream(), torch.cuda.default_stream()),
        "pool + pool": (torch.cuda.Stream(), torch.cuda.Stream()),
    }
    for name, (a, b) in pairs.items():
        r = check_pair(a, b, nbytes, args.reps)
        print(f"{name:26s} D2H {r['d2h_ms']:.3f} ms ({r['d2h_gbs']:.1f} GB/s)  H2D "
              f"{r['h2d_ms']:.3f} ms ({r['h2d_gbs']:.1f} GB/s)  both {r['both_ms']:.3f} ms  "
              f"overlap {r['overlap']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
