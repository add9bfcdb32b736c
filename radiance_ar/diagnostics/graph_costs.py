"""What the op's graphs cost besides a replay: a shape's first call, its capture, and the
memory a graph holds.

A replayed op call costs the host one launch (:mod:`radiance_ar.overlap.graphs`); the
calls before it do not. The first call of a shape and layer runs step by step (it sizes
the buffers, loads the kernels), the second captures and instantiates the graph, then
replays it; a graph dropped for room (``RADIANCE_AR_OP_GRAPHS_PER_LAYER``) is captured
again at its next call. A serving engine meets the first two at every new M that recurs,
and pays the memory for every layer and M it keeps. For ``--layers`` layers (distinct
weights, registered in order as the vLLM installer does) of one shape, one active emulated
rank against passive peers (the compare tool's timing mode), this measures:

- ``first``: host and device time of each layer's first (eager) call, median over layers
  (``first_of_process``: the very first, which also sizes buffers and loads kernels);
- ``capture``: the same of its second call (capture, instantiation and the first replay);
- ``replay``: median host and device time of later calls;
- ``graph_driver_bytes``: device memory the captures took outside torch's allocator (the
  ``mem_get_info`` drop less the ``memory_reserved`` rise: the instantiated graphs), per
  graph; ``allocator_bytes``: the ``memory_reserved`` rise of the captures in all (the
  persistent input and output, the graph pool, the first replays' outputs);
  ``graph_host_bytes``: the process's resident memory they added (Linux
  ``/proc/self/statm``; None elsewhere), per graph.

    python -m radiance_ar.diagnostics.graph_costs --backend sdma_wht6 --world 4 --rows 8192 --layers 32
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from radiance_ar.diagnostics import write_json
from radiance_ar.diagnostics.host_cost import (add_call_args, host_and_device_us,
                                               passive_peer_runtime)
from radiance_ar.envs import BackendSettings
from radiance_ar.harness.host import resident_bytes


def _median_ms(timings: list[tuple[float, float]]) -> dict[str, float]:
    """{host_ms, device_ms}: medians of (host us, device us) pairs."""
    return {"host_ms": statistics.median(h for h, _ in timings) / 1e3,
            "device_ms": statistics.median(d for _, d in timings) / 1e3}


def _memory(device: torch.device) -> tuple[int, int, int | None]:
    """After a synchronize: the device's free bytes, torch's reserved bytes, and this
    process's resident bytes."""
    torch.cuda.synchronize()
    return (torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device),
            resident_bytes())


def measure(name: str, size: int, rows: int, cols: int, k: int, slices: int | str,
            layers: int, calls: int) -> dict:
    """The record of one shape (see the module doc)."""
    from radiance_ar.overlap.config import OverlapSettings
    from radiance_ar.overlap.op import forward

    device = torch.device("cuda", torch.cuda.current_device())
    settings = OverlapSettings(True, name, 1, slices, BackendSettings.from_env(), graphs="on",
                               graphs_per_layer=1)
    with passive_peer_runtime(settings, size, rows, cols) as rt:
        x = torch.randn(rows, k, device=device).to(torch.bfloat16)
        weights = [torch.randn(cols, k, device=device).to(torch.bfloat16) for _ in range(layers)]
        for w in weights:
            rt.register_layer(w)
        calls_of = [lambda w=w: forward(rt, x, w, None, "bf16") for w in weights]
        check = rt.backend.check
        first = [host_and_device_us(call, check, 1, 0) for call in calls_of]
        free_before, reserved_before, host_before = _memory(device)
        capture = [host_and_device_us(call, check, 1, 0) for call in calls_of]
        free_after, reserved_after, host_after = _memory(device)
        allocator = reserved_after - reserved_before
        graphs = rt.graphs()
        assert graphs is not None and graphs.captures == layers, "every layer captured once"
        replay = [host_and_device_us(calls_of[0], check, calls, 3)]
        return {"backend": name, "W": size, "rows": rows, "cols": cols, "k": k,
                "slices": slices, "layers": layers, "first": _median_ms(first),
                "first_of_process": _median_ms(first[:1]),
                "capture": _median_ms(capture), "replay": _median_ms(replay),
                "graph_driver_bytes": (free_before - free_after - allocator) / layers,
                "allocator_bytes": allocator,
                "graph_host_bytes": (None if host_before is None or host_after is None
                                     else (host_after - host_before) / layers),
                "static_bytes": graphs.memory()["static_bytes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(p, "sdma_wht6", "2048,8192", "comma-separated M values", 50)
    p.add_argument("--slices", default="auto", help="slices per call, or auto (default)")
    p.add_argument("--layers", type=int, default=32, help="layers captured (default 32)")
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    args = p.parse_args(argv)
    if args.world < 2 or args.backend == "auto":
        p.error("--world must be >= 2 and --backend a registered backend, not auto (one rank "
                "replays nothing; auto's graphs live in its chosen configurations' runtimes)")
    if not torch.cuda.is_available():
        print("graph_costs: needs a CUDA device (the op's graphs are CUDA graphs)", file=sys.stderr)
        return 2
    slices = args.slices if args.slices == "auto" else int(args.slices)
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        rec = measure(args.backend, args.world, rows, args.cols, args.k, slices, args.layers,
                      args.calls)
        records.append(rec)
        host_mib = ("n/a" if rec["graph_host_bytes"] is None
                    else f"{rec['graph_host_bytes'] / 2 ** 20:.2f}")
        print(f"{rec['backend']} W={rec['W']} M={rows} S={slices}: first call host "
              f"{rec['first']['host_ms']:.2f} / device {rec['first']['device_ms']:.2f} ms, "
              f"capture {rec['capture']['host_ms']:.2f} / {rec['capture']['device_ms']:.2f} ms, "
              f"replay {rec['replay']['host_ms']:.3f} / {rec['replay']['device_ms']:.3f} ms; "
              f"per graph {rec['graph_driver_bytes'] / 2 ** 20:.2f} MiB of driver memory, "
              f"{host_mib} MiB host; allocator {rec['allocator_bytes'] / 2 ** 20:.0f} MiB in all "
              f"({args.layers} layers)")
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
