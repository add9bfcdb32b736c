"""Host time of each kind of step a copy-engine call enqueues, one kind at a time.

``radiance_ar.diagnostics.host_cost`` gives the host time of a whole call; this splits it into its
parts. Each row is the median host time of one enqueue of that kind, over ``--calls``
enqueues made back to back on one stream, with device work too small to push back on
the host (4 KiB copies, flags already at their value, 16-row kernels):

- ``cudaMemcpyAsync`` / ``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` through the
  CUDA Python bindings (what ``radiance_ar.transport.copy_engine`` calls) and, beside them, the same
  driver entry points called through ``ctypes`` on ``libcuda`` (``cuMemcpyAsync``,
  ``cuStreamWriteValue32_v2``, ``cuStreamWaitValue32_v2``): whether the bindings'
  argument wrapping is a share of the per-step cost;
- ``CopyEngine.copy`` and ``.wait_value_geq`` (the project's layer around them);
- a CUDA event record, a stream wait on an event, ``current_stream_handle``;
- the Triton launches of the codec and the reduce: ``wht6.encode``,
  ``wht6.decode_accumulate`` of 4 payloads, ``reduce_sum`` of 4 inputs.

    python -m radiance_ar.diagnostics.host_steps --calls 2000
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from typing import Callable

import torch

from radiance_ar import wht6
from radiance_ar.transport.copy_engine import CopyEngine
from radiance_ar.transport.cuda_ops import cuda_copy, cuda_wait_value, cuda_write_value
from radiance_ar.streams import current_stream_handle
from radiance_ar.backends.kernels import reduce_sum
from radiance_ar.diagnostics import write_json

#: CUstreamWaitValue_flags / CUstreamWriteValue_flags values (cuda.h)
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0


#: enqueues between (untimed) synchronizations: the queue never fills and pushes back
DRAIN_EVERY = 64


def median_us(fn: Callable[[int], None], calls: int, warmup: int = 50) -> float:
    """Median host time of ``fn(i)``, in microseconds (timed one call at a time; the
    device is drained every ``DRAIN_EVERY`` calls, outside the timed spans)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(calls):
        if i % DRAIN_EVERY == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn(i)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def libcuda_calls() -> dict[str, Callable]:
    """The three driver entry points through ctypes, argument types declared."""
    lib = ctypes.CDLL("libcuda.so.1")
    u64, u32, vp = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
    memcpy = lib.cuMemcpyAsync
    memcpy.argtypes, memcpy.restype = [u64, u64, ctypes.c_size_t, vp], ctypes.c_int
    write = lib.cuStreamWriteValue32_v2
    write.argtypes, write.restype = [vp, u64, u32, ctypes.c_uint], ctypes.c_int
    wait = lib.cuStreamWaitValue32_v2
    wait.argtypes, wait.restype = [vp, u64, u32, ctypes.c_uint], ctypes.c_int
    return {"memcpy": memcpy, "write": write, "wait": wait}


def checked(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} returned CUresult {result}")


def measure(calls: int) -> list[dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    handle = stream.cuda_stream
    engine = CopyEngine(device)
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    src, dst = pinned[:4096], dev_buf[:4096]
    flag_addr = engine.device_address(pinned[-64:])
    raw = libcuda_calls()
    x = torch.randn(16, 5120, device=device).to(torch.bfloat16)
    payload = wht6.encode(x)
    out = torch.empty_like(x)
    rows = []

    def row(step: str, fn: Callable[[int], None]) -> None:
        with torch.cuda.stream(stream):
            us = median_us(fn, calls)
        torch.cuda.synchronize(device)
        rows.append({"step": step, "host_us": us})

    pinned[-64:].zero_()
    row("cudaMemcpyAsync 4 KiB H2D (cuda-python)",
        lambda i: cuda_copy(dst.data_ptr(), src.data_ptr(), 4096, handle))
    row("cuMemcpyAsync 4 KiB H2D (ctypes)",
        lambda i: checked(raw["memcpy"](dst.data_ptr(), src.data_ptr(), 4096, handle),
                          "cuMemcpyAsync"))
    row("CopyEngine.copy 4 KiB H2D", lambda i: engine.copy(dst, src, handle))
    row("cuStreamWriteValue32 (cuda-python)", lambda i: cuda_write_value(handle, flag_addr, 0))
    row("cuStreamWriteValue32_v2 (ctypes)",
        lambda i: checked(raw["write"](handle, flag_addr, 0, CU_STREAM_WRITE_VALUE_DEFAULT),
                          "cuStreamWriteValue32_v2"))
    row("cuStreamWaitValue32 GEQ, passed (cuda-python)",
        lambda i: cuda_wait_value(handle, flag_addr, 0, equal=False))
    row("cuStreamWaitValue32_v2 GEQ, passed (ctypes)",
        lambda i: checked(raw["wait"](handle, flag_addr, 0, CU_STREAM_WAIT_VALUE_GEQ),
                          "cuStreamWaitValue32_v2"))
    row("CopyEngine.wait_value_geq", lambda i: engine.wait_value_geq(handle, flag_addr, 0))
    event = torch.cuda.Event()
    row("torch.cuda.Event.record", lambda i: event.record(stream))
    row("Stream.wait_event", lambda i: stream.wait_event(event))
    row("current_stream_handle", lambda i: current_stream_handle(device))
    row("wht6.encode 16 x 5120", lambda i: wht6.encode(x, out=payload))
    row("wht6.decode_accumulate 4 x 16 x 5120",
        lambda i: wht6.decode_accumulate([payload] * 4, tuple(x.shape), x.dtype, out=out))
    row("reduce_sum 4 x 16 x 5120", lambda i: reduce_sum.reduce_sum([x] * 4, out))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="timed enqueues per step (default 2000)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.version.hip is not None:
        print("host_steps: needs an NVIDIA device (the ctypes rows call libcuda)", file=sys.stderr)
        return 2
    rows = measure(args.calls)
    for r in rows:
        print(f"{r['host_us']:8.2f} us  {r['step']}")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
