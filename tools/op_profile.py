"""Where one replayed op call's device time goes: its kernels and copies, per stream.

One active emulated rank against passive peers (as the compare tool times it, op calls
replayed from captured graphs), profiled with ``torch.profiler`` (CUPTI records the
kernels and copies a graph launches; stream waits and flag writes are not recorded, so
a gap on a stream is a wait or idle time). After warm-up, ``--calls`` op calls run,
each after a synchronize and a marker kernel; the last is reported: every kernel and copy
with its stream, start and end in us from the call's first event, per stream the busy time,
and per copy direction the busy time, idle share and overlap (:func:`per_direction`).

    python tools/op_profile.py --world 2 --m 8192 --slices 4 --backend sdma_wht6 --json out.json

GPU only: the tool exits with an error where no CUDA/ROCm device is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import producer_inputs  # noqa: E402
from emulated_measure import active_runtimes  # noqa: E402
from world_measure import Case, shard  # noqa: E402
from radiance_ar.overlap.op import forward  # noqa: E402
from radiance_ar.transport.world import emulated_worlds  # noqa: E402

#: device activity kinds the report keeps (the profiler's categories)
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
#: the name of the kernel ``torch.cuda._sleep`` launches: the mark before each call
MARKER = "spin_kernel"


def short_name(name: str) -> str:
    """A kernel's or copy's name, cut to what tells it apart (templates and args dropped)."""
    name = name.split("(")[0].split("<")[0]
    return name if len(name) <= 48 else name[:45] + "..."


def last_call_events(trace: dict) -> list[dict]:
    """The device events of the last op call in a chrome ``trace``: those after the end of
    the last marker kernel (``torch.cuda._sleep``'s ``spin_kernel``, launched before each
    call after a synchronize). A device clock, not the host's: the host range of a call
    was seen 0.4 ms off its device work on the H200."""
    device = [e for e in trace["traceEvents"] if e.get("cat") in DEVICE_KINDS and e.get("ph") == "X"]
    start = max(e["ts"] + e["dur"] for e in device if MARKER in e["name"])
    events = [e for e in device if e["ts"] >= start and MARKER not in e["name"]]
    t0 = min(e["ts"] for e in events)
    return sorted(({"name": short_name(e["name"]) if e["cat"] == "kernel" else e["name"],
                    "kind": e["cat"],
                    "stream": e.get("args", {}).get("stream", e.get("tid")),
                    "start_us": round(e["ts"] - t0, 1), "end_us": round(e["ts"] + e["dur"] - t0, 1),
                    "bytes": e.get("args", {}).get("bytes")} for e in events),
                  key=lambda e: e["start_us"])


def busy_us(events: list[dict]) -> float:
    """The time at least one of ``events`` runs: the union of their intervals, in us."""
    busy, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["start_us"]):
        busy += max(0.0, e["end_us"] - max(e["start_us"], end))
        end = max(end, e["end_us"])
    return round(busy, 1)


def per_stream(events: list[dict]) -> dict:
    """Stream -> first start, last end and busy us (its events' union) of one call."""
    groups: dict = {}
    for e in events:
        groups.setdefault(str(e["stream"]), []).append(e)
    return {stream: {"first_us": min(e["start_us"] for e in es),
                     "last_us": max(e["end_us"] for e in es), "busy_us": busy_us(es)}
            for stream, es in groups.items()}


def per_direction(events: list[dict]) -> dict:
    """Copy direction (``HtoD``, ``DtoH``, ``DtoD``: the word after ``Memcpy`` in the copy's
    name) -> its copies over every stream: how many, their bytes, ``busy_us`` (their union),
    ``span_us`` (first start to last end), ``idle_share`` (of the span, no copy of that
    direction running) and ``overlap_us`` (their summed durations less the union: time two
    or more ran at once). In a W = 4 call of sdma_wht6 the H2D pulls carry the call, and
    their idle share is what overlapping slices could win back (24% on an H100,
    tools/results/2026-12-05-h100-gemm-pieces-and-waits/)."""
    groups: dict = {}
    for e in events:
        if e["kind"] == "gpu_memcpy" and e["name"].startswith("Memcpy "):
            groups.setdefault(e["name"].split()[1], []).append(e)
    out = {}
    for direction, es in groups.items():
        busy = busy_us(es)
        span = max(e["end_us"] for e in es) - min(e["start_us"] for e in es)
        out[direction] = {
            "copies": len(es), "bytes": sum(e["bytes"] or 0 for e in es), "busy_us": busy,
            "span_us": round(span, 1), "idle_share": round(1 - busy / span, 3) if span else 0.0,
            "overlap_us": round(max(0.0, sum(e["end_us"] - e["start_us"] for e in es) - busy), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="emulated ranks W (default 2)")
    p.add_argument("--backend", default="sdma_wht6")
    p.add_argument("--m", type=int, default=8192, help="rows M (default 8192)")
    p.add_argument("--n", type=int, default=5120, help="columns N (default 5120)")
    p.add_argument("--k", type=int, default=4352, help="inner size K (default 4352)")
    p.add_argument("--slices", type=int, default=4, help="slices S (default 4)")
    p.add_argument("--calls", type=int, default=5, help="profiled op calls (default 5)")
    p.add_argument("--json", required=True, help="where the report goes")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("op_profile needs a CUDA/ROCm device; none is visible")
    device = torch.device("cuda", 0)
    case = Case(args.backend, args.m, args.n, args.k, args.slices, reps=args.calls, warmup=3)
    world = emulated_worlds(args.world, device)[0]
    rt, _ = active_runtimes(world, case, op_only=True)
    try:
        ops = producer_inputs.operands(case.producer, *shard(case, world.rank, device))
        rt.backend.ensure_capacity(case.rows, case.cols, torch.bfloat16)
        rt.backend.fill_passive_peers()
        for _ in range(5):  # warm-up: kernels loaded, the call's graph captured
            forward(rt, ops.x, ops.weight, ops.weight_scale, case.producer)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                torch.cuda._sleep(1000)  # the mark (MARKER): about a microsecond
                forward(rt, ops.x, ops.weight, ops.weight_scale, case.producer)
                torch.cuda.synchronize()
        trace_path = args.json + ".trace.json"
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            events = last_call_events(json.load(f))
        os.remove(trace_path)
        report = {"W": args.world, "backend": args.backend, "M": args.m, "N": args.n,
                  "K": args.k, "slices": args.slices, "op_graphs": rt.graph_reason() or "replayed",
                  "call_us": max(e["end_us"] for e in events), "streams": per_stream(events),
                  "copies": per_direction(events), "events": events}
    finally:
        rt.close()
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{args.backend} W={args.world} M={args.m} S={args.slices} ({report['op_graphs']}): "
          f"{report['call_us']:.1f} us")
    for direction, c in report["copies"].items():
        print(f"  {direction}: {c['copies']} copies, {c['bytes'] / 1e6:.1f} MB, busy "
              f"{c['busy_us']:.0f} of {c['span_us']:.0f} us ({c['idle_share']:.0%} idle), "
              f"{c['overlap_us']:.0f} us overlapped")
    for e in events:
        print(f"  {e['stream']:>6} {e['start_us']:8.1f} {e['end_us']:8.1f}  {e['kind']:10} "
              f"{e['name']} {e['bytes'] or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
