"""Device time of one two-shot slice's pulls, enqueued in different orders (NVIDIA).

An sdma two-shot slice at W = 4 pulls three shards (one per peer, each behind a stream
wait on that peer's flag), reduces, then pulls three reduced shards the same way. Step
timelines (H200, 2026-12-03) put each wait plus the gaps around it at 6-10 us of device
time, and 2.5 MiB pulls at 42-48 GB/s where back-to-back copies reach 52: this times the
transfer part of a slice (no reduce, no GEMM) in each order the transport could use,
with pinned host memory as the peers' buffers (the emulated world) and every flag
already up (the timing mode's passive peers):

- ``copies``: the six copies back to back, no waits (the floor);
- ``wait,copy``: wait for a peer, pull it, next (the transport's order before its waits
  were batched);
- ``waits,copies``: per phase, the three waits, then the three copies;
- ``batched waits``: per phase, ONE ``cuStreamBatchMemOp`` holding the three waits (what
  ``CopyTransport.pull_from`` enqueues now);
- ``peer streams``: per phase, each peer's wait and copy on its own stream, joined by
  events (copies of different peers may run on different copy engines at once);
- ``+lane``: the same with the emulated world's publish beside it (a D2H of the whole
  slice on a second stream at the slice's start, one of the shard after phase 1).

Each row: the median device time per slice over ``--slices`` slices enqueued back to
back behind a device sleep (the host far ahead), and the pulled bytes' rate.

    python -m radiance_ar.diagnostics.pull_steps --shard-mib 2.5,5 --json pull_steps.json
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import struct
import sys
from typing import Callable

import torch

from radiance_ar.transport.copy_engine import CopyEngine
from radiance_ar.transport.cuda_ops import cuda_copy, cuda_wait_value
from radiance_ar.diagnostics import write_json

PEERS = 3
#: cuda.h: CU_STREAM_MEM_OP_WAIT_VALUE_32, CU_STREAM_WAIT_VALUE_GEQ
MEM_OP_WAIT_VALUE_32, WAIT_GEQ = 1, 0
#: sizeof(CUstreamBatchMemOpParams) (a union padded to 6 x 64 bits)
BATCH_PARAM_BYTES = 48
#: device clock cycles per ms for torch.cuda._sleep (H200 ~1.98 GHz; a longer lead is harmless)
CYCLES_PER_MS = 2_000_000


def batch_wait_call() -> Callable[[int, list[int], int], None]:
    """``f(stream, addresses, value)``: one ``cuStreamBatchMemOp_v2`` of 32-bit GEQ waits."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuStreamBatchMemOp_v2
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def call(stream: int, addresses: list[int], value: int) -> None:
        raw = bytearray(BATCH_PARAM_BYTES * len(addresses))
        for i, addr in enumerate(addresses):
            # waitValue: operation u32 @0, address u64 @8, value u32 @16, flags u32 @24
            struct.pack_into("<IxxxxQIxxxxI", raw, i * BATCH_PARAM_BYTES,
                             MEM_OP_WAIT_VALUE_32, addr, value, WAIT_GEQ)
        buf = (ctypes.c_char * len(raw)).from_buffer(raw)
        err = fn(stream, len(addresses), ctypes.addressof(buf), 0)
        if err != 0:
            raise RuntimeError(f"cuStreamBatchMemOp_v2 returned CUresult {err}")
    return call


class Slice:
    """The buffers of one slice's transfers and the orders of enqueueing them."""

    def __init__(self, device: torch.device, shard: int):
        self.shard = shard
        self.engine = CopyEngine(device)
        pinned = dict(pin_memory=True, dtype=torch.uint8)
        self.pub = [torch.full((shard,), 7, **pinned) for _ in range(PEERS)]
        self.red = [torch.full((shard,), 9, **pinned) for _ in range(PEERS)]
        self.flags = torch.ones(64, dtype=torch.int32, pin_memory=True)
        self.flag_addr = [self.engine.device_address(self.flags[4 * p:4 * p + 1])
                          for p in range(PEERS)]
        self.recv = torch.empty(PEERS * shard, dtype=torch.uint8, device=device)
        self.out = torch.empty((PEERS + 1) * shard, dtype=torch.uint8, device=device)
        self.own_pub = torch.empty((PEERS + 1) * shard, **pinned)
        self.side = [torch.cuda.Stream(device) for _ in range(PEERS)]
        self.lane = torch.cuda.Stream(device)
        self.batch_wait = batch_wait_call()

    def _phase(self, order: str, main: torch.cuda.Stream, srcs: list[torch.Tensor],
               dst: torch.Tensor) -> None:
        h, n = main.cuda_stream, self.shard
        dst_at = [dst.data_ptr() + p * n for p in range(PEERS)]
        if order == "copies":
            for p in range(PEERS):
                cuda_copy(dst_at[p], srcs[p].data_ptr(), n, h)
        elif order == "wait,copy":
            for p in range(PEERS):
                cuda_wait_value(h, self.flag_addr[p], 1, equal=False)
                cuda_copy(dst_at[p], srcs[p].data_ptr(), n, h)
        elif order == "waits,copies":
            for p in range(PEERS):
                cuda_wait_value(h, self.flag_addr[p], 1, equal=False)
            for p in range(PEERS):
                cuda_copy(dst_at[p], srcs[p].data_ptr(), n, h)
        elif order == "batched waits":
            self.batch_wait(h, self.flag_addr, 1)
            for p in range(PEERS):
                cuda_copy(dst_at[p], srcs[p].data_ptr(), n, h)
        elif order == "peer streams":
            start = torch.cuda.Event()
            start.record(main)
            for p, s in enumerate(self.side):
                s.wait_event(start)
                cuda_wait_value(s.cuda_stream, self.flag_addr[p], 1, equal=False)
                cuda_copy(dst_at[p], srcs[p].data_ptr(), n, s.cuda_stream)
                end = torch.cuda.Event()
                end.record(s)
                main.wait_event(end)
        else:
            raise ValueError(f"pull_steps: unknown order {order!r}")

    def enqueue(self, order: str, lane: bool, main: torch.cuda.Stream) -> None:
        """One slice: phase 1 (shards of pub), phase 2 (reduced shards of red)."""
        if lane:
            self.lane.wait_stream(main)
            cuda_copy(self.own_pub.data_ptr(), self.out.data_ptr(), self.out.numel(),
                      self.lane.cuda_stream)
        self._phase(order, main, self.pub, self.recv)
        if lane:
            self.lane.wait_stream(main)
            cuda_copy(self.own_pub.data_ptr(), self.out.data_ptr(), self.shard,
                      self.lane.cuda_stream)
        self._phase(order, main, self.red, self.out)
        if lane:
            main.wait_stream(self.lane)


def time_order(sl: Slice, order: str, lane: bool, slices: int) -> dict:
    main = torch.cuda.Stream(sl.recv.device)
    with torch.cuda.stream(main):
        for _ in range(3):
            sl.enqueue(order, lane, main)
        torch.cuda.synchronize()
        torch.cuda._sleep(20 * CYCLES_PER_MS)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(slices + 1)]
        events[0].record(main)
        for i in range(slices):
            sl.enqueue(order, lane, main)
            events[i + 1].record(main)
        torch.cuda.synchronize()
    per = [a.elapsed_time(b) * 1e3 for a, b in zip(events, events[1:])]
    us, (q1, _, q3) = statistics.median(per), statistics.quantiles(per, n=4)
    return {"order": order, "lane": lane, "shard_bytes": sl.shard, "us_per_slice": us,
            "spread_us": (q3 - q1) / 2, "pulled_gbs": 2 * PEERS * sl.shard / us / 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shard-mib", default="2.5,5", help="shard sizes, MiB (default 2.5,5)")
    p.add_argument("--slices", type=int, default=30, help="timed slices per row (default 30)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.version.hip is not None:
        print("pull_steps: needs an NVIDIA device (the batched wait calls libcuda)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for mib in (float(x) for x in args.shard_mib.split(",")):
        sl = Slice(device, int(mib * (1 << 20)))
        for lane in (False, True):
            for order in ("copies", "wait,copy", "waits,copies", "batched waits", "peer streams"):
                try:
                    r = time_order(sl, order, lane, args.slices)
                except RuntimeError as e:
                    r = {"order": order, "lane": lane, "shard_bytes": sl.shard, "error": str(e)}
                rows.append(r)
                print(f"shard {mib:5.2f} MiB  {order:14s} {'+lane' if lane else '     '}  "
                      + (f"{r['us_per_slice']:8.1f} us/slice (+-{r['spread_us']:.1f})  "
                         f"{r['pulled_gbs']:5.1f} GB/s" if "error" not in r else r["error"]),
                      flush=True)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
