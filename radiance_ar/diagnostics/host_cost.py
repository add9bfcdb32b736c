"""What one all-reduce call costs the HOST, against what it costs the device.

In the emulated world one host thread enqueues every copy, flag and kernel of a call.
When enqueueing a slice's call takes longer than the device needs to run it, the
device idles between slices and slicing finer makes the op slower: a per-slice tax
that device events alone cannot explain. This measures, for one active rank against
passive peers (as the compare tool times it), per call of ``rows x cols`` bf16:

- ``host_us``: wall time of the Python call that enqueues it (no synchronization
  inside; the device is drained before each call so the queue never pushes back);
- ``device_us``: device-event time of the same call;
- with ``--profile``, the functions that take the host time (cProfile, by own time),
  once with the device drained before each call and once for calls enqueued back to
  back (as the op's slices are): a call that blocks the host until the device has
  progressed shows up only in the second, as a large own time.

    python -m radiance_ar.diagnostics.host_cost --backend sdma --world 4 --rows 1024,2048 --calls 100

``--op-slices S``: the same for one call of the whole op (``radiance_ar.overlap.op.forward``, bf16
GEMM of ``rows x --k`` by ``--k x cols``, S slices) instead of one bare all-reduce: what
the host spends before the first slice's all-reduce is enqueued shows up there.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from typing import Iterator

import torch

from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.diagnostics import write_json
from radiance_ar.harness.host import freeze_heap


def host_and_device_us(call, check, calls: int, warmup: int) -> tuple[float, float]:
    """Median host enqueue time and median device time of one ``call()``, in
    microseconds; ``check()`` ends the run (the backend's bounded wait). The heap is
    frozen first, as the timing tools freeze it (:mod:`radiance_ar.harness.host`)."""
    freeze_heap()
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    host, device = [], []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) * 1e3)
    check()
    return statistics.median(host), statistics.median(device)


def profile_calls(call, check, calls: int, top: int, back_to_back: bool,
                  sort: str = "tottime") -> str:
    """cProfile of ``calls`` enqueues, top by ``sort``: the device drained before each
    call, or (``back_to_back``) all enqueued in one go."""
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        call()
        prof.disable()
        if not back_to_back:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    check()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue()


def _all_reduce_call(backend, rows: int, cols: int, device: torch.device):
    """One bare all-reduce of ``rows x cols`` bf16 (the backend's input view if it has one)."""
    ar_in = (backend.acquire_input_view(rows, cols, torch.bfloat16)
             if backend.peer_visible_input
             else torch.randn(rows, cols, device=device).to(torch.bfloat16))
    ar_in.normal_()
    ar_out = torch.empty_like(ar_in)
    return lambda: backend.all_reduce(ar_in, ar_out)


def _op_call(rt, rows: int, cols: int, k: int, device: torch.device):
    """One call of the op: a bf16 GEMM ``rows x k`` by ``k x cols`` and its all-reduce."""
    from radiance_ar.overlap.op import forward

    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    w = torch.randn(cols, k, device=device).to(torch.bfloat16)
    return lambda: forward(rt, x, w, None, "bf16")


@contextlib.contextmanager
def passive_peer_runtime(settings, size: int, rows: int, cols: int) -> Iterator:
    """The op's runtime (``settings``) of one emulated rank of ``size`` on this GPU, its
    buffers grown for ``rows x cols`` bf16 and its peers passive (the compare tool's
    timing mode: no stream waits on a peer); closed on exit."""
    from radiance_ar import overlap

    device = torch.device("cuda", torch.cuda.current_device())
    rt = overlap.build(emulated_worlds(size, device)[0], settings)
    try:
        rt.backend.ensure_capacity(rows, cols, torch.bfloat16)
        rt.backend.fill_passive_peers()
        yield rt
    finally:
        rt.close()


def add_call_args(p: argparse.ArgumentParser, backend: str, rows: str, rows_help: str,
                  calls: int) -> None:
    """The options of the calls a diagnostic times: backend, world, rows, N, K, calls."""
    p.add_argument("--backend", default=backend, help=f"registered backend (default {backend})")
    p.add_argument("--world", type=int, default=4, help="emulated ranks (default 4)")
    p.add_argument("--rows", default=rows, help=f"{rows_help} (default {rows})")
    p.add_argument("--cols", type=int, default=5120, help="N, the output columns (default 5120)")
    p.add_argument("--k", type=int, default=4352,
                   help="the op's GEMM inner dimension (default 4352)")
    p.add_argument("--calls", type=int, default=calls, help=f"timed calls (default {calls})")


def measure(name: str, size: int, rows: int, cols: int, calls: int, warmup: int,
            profile: bool, top: int, op_slices: int = 0, k: int = 4352,
            sort: str = "tottime") -> dict:
    """``op_slices`` 0: a bare all-reduce call; else one op call with that many slices."""
    from radiance_ar.overlap.config import OverlapSettings

    device = torch.device("cuda", torch.cuda.current_device())
    settings = OverlapSettings(True, name, 1, max(op_slices, 1), BackendSettings.from_env())
    with passive_peer_runtime(settings, size, rows, cols) as rt:
        backend = rt.backend
        call = (_op_call(rt, rows, cols, k, device) if op_slices
                else _all_reduce_call(backend, rows, cols, device))
        host, dev = host_and_device_us(call, backend.check, calls, warmup)
        record = {"backend": name, "W": size, "rows": rows, "cols": cols,
                  "op_slices": op_slices, "mib": rows * cols * 2 / 2 ** 20,
                  "host_us": host, "device_us": dev, "host_bound": host > dev}
        if profile:
            record["profile"] = profile_calls(call, backend.check, min(calls, 50), top, False,
                                              sort)
            record["profile_back_to_back"] = profile_calls(call, backend.check, min(calls, 20),
                                                           top, True, sort)
        return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(p, "sdma", "1024,2048", "comma-separated slice rows", 100)
    p.add_argument("--warmup", type=int, default=10, help="untimed calls (default 10)")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the calls")
    p.add_argument("--top", type=int, default=25, help="profile lines (default 25)")
    p.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"),
                   help="profile order: own time (default) or cumulative")
    p.add_argument("--op-slices", type=int, default=0, metavar="S",
                   help="time one op call with S slices instead of a bare all-reduce")
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost: needs a CUDA/ROCm device", file=sys.stderr)
        return 2
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        rec = measure(args.backend, args.world, rows, args.cols, args.calls, args.warmup,
                      args.profile, args.top, args.op_slices, args.k, args.sort)
        records.append(rec)
        what = f"op S={args.op_slices} " if args.op_slices else ""
        print(f"{rec['backend']} {what}W={rec['W']} {rows}x{args.cols} ({rec['mib']:.1f} MiB): "
              f"host {rec['host_us']:.0f} us, device {rec['device_us']:.0f} us"
              f"{'  HOST-BOUND' if rec['host_bound'] else ''}")
        if "profile" in rec:
            print("-- device drained before each call\n" + rec["profile"])
            print("-- calls back to back\n" + rec["profile_back_to_back"])
    write_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
