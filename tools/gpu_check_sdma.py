"""Check the sdma backend's GPU building blocks on one GPU and time its transport.

    python tools/gpu_check_sdma.py [--json OUT.json]

1. stream memory operations through cuda-bindings: write-value to pinned host and to
   device memory; a wait-value on a pinned host flag released by the host; a wait-value
   on a device flag released by another stream; cyclic GEQ with a passive (max) flag.
2. the no-compute-unit proof (:mod:`radiance_ar.diagnostics.cu_free_check`).
3. timing, labelled "1 GPU, W emulated ranks over PCIe": one active rank against W-1
   passive pre-filled peers, 8192 x 5120 bf16 (80 MiB), one-shot and two-shot; and the
   contention: a bf16 GEMM 8192x4352x5120 alone vs while the transport runs beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch  # noqa: E402

from radiance_ar import envs  # noqa: E402
from radiance_ar.transport.copy_engine import CopyEngine  # noqa: E402
from radiance_ar.backends.sdma import SdmaBackend  # noqa: E402
from radiance_ar.overlap.plan import input_view  # noqa: E402
from radiance_ar.transport.signals import PASSIVE_EPOCH  # noqa: E402
from radiance_ar.transport.world import emulated_worlds  # noqa: E402
from radiance_ar.diagnostics import cu_free_check  # noqa: E402

envs.prepare_cuda_for_emulated_ranks()  # importing torch does not start CUDA; main() does
DEV = torch.device("cuda", 0)


def _done_within(event: torch.cuda.Event, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if event.query():
            return True
        time.sleep(1e-4)
    return event.query()


def memops() -> dict:
    eng = CopyEngine(DEV)
    s1, s2 = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
    host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
    dev = torch.zeros(4, dtype=torch.int64, device=DEV)
    haddr, daddr = eng.device_address(host), eng.device_address(dev)
    res = {"host_ptr_equals_device_ptr": haddr == host.data_ptr()}
    eng.write_value(s1.cuda_stream, haddr, 7)
    eng.write_value(s1.cuda_stream, daddr, 9)
    s1.synchronize()
    res["write_host"], res["write_device"] = int(host[0]), int(dev[0].item())
    # wait on a pinned host flag; the host releases it
    ev = torch.cuda.Event()
    eng.wait_value_geq(s1.cuda_stream, haddr + 8, 1)
    eng.write_value(s1.cuda_stream, haddr + 16, 5)
    ev.record(s1)
    res["host_wait_blocked"] = not _done_within(ev, 0.1) and int(host[2]) == 0
    host[1] = 1
    res["host_wait_released"] = _done_within(ev, 2.0) and int(host[2]) == 5
    # wait on a device flag; another stream releases it
    ev2 = torch.cuda.Event()
    eng.wait_value_geq(s1.cuda_stream, daddr + 8, 3)
    ev2.record(s1)
    res["device_wait_blocked"] = not _done_within(ev2, 0.1)
    eng.write_value(s2.cuda_stream, daddr + 8, 3)
    res["device_wait_released"] = _done_within(ev2, 2.0)
    # cyclic GEQ: a passive flag passes any epoch below 2^31
    host[3] = PASSIVE_EPOCH
    ev3 = torch.cuda.Event()
    eng.wait_value_geq(s1.cuda_stream, haddr + 24, 123456)
    ev3.record(s1)
    res["passive_flag_passes"] = _done_within(ev3, 2.0)
    torch.cuda.synchronize()
    return res


def cu_free() -> list[dict]:
    out = []
    for r in cu_free_check.standard_checks(DEV):
        print(r, flush=True)
        out.append(vars(r))
    return out


def _median_ms(fn, reps: int = 10) -> float:
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def timing(rows: int = 8192, cols: int = 5120, k: int = 4352) -> list[dict]:
    out = []
    settings = envs.BackendSettings.from_env()  # the spin bound; each schedule in turn
    for size in (2, 4):
        for schedule in ("oneshot", "twoshot"):
            be = SdmaBackend(emulated_worlds(size, DEV)[0],
                             settings.replace(sdma_schedule=schedule))
            be.ensure_capacity(rows, cols, torch.bfloat16)
            be.fill_passive_peers()
            y = input_view(be, rows, cols, torch.bfloat16)
            y.normal_()
            res = torch.empty_like(y)
            before = be.pulled_bytes
            ms = _median_ms(lambda: be.all_reduce(y, res))
            be.check(10000)
            pulled = (be.pulled_bytes - before) // 12
            out.append({"W": size, "schedule": schedule, "ar_ms": round(ms, 3),
                        "pulled_MiB": round(pulled / 2**20, 1),
                        "pull_GBps": round(pulled / ms / 1e6, 1),
                        "wire_bytes": be.wire_bytes(rows * cols, size)})
            print(out[-1], flush=True)
    # contention: GEMM alone vs beside the one-shot W=4 transport on another stream
    a = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(cols, k, device=DEV, dtype=torch.bfloat16)
    c = torch.empty(rows, cols, device=DEV, dtype=torch.bfloat16)
    gemm = lambda: torch.mm(a, w.t(), out=c)  # noqa: E731
    alone = _median_ms(gemm, 20)
    be = SdmaBackend(emulated_worlds(4, DEV)[0], settings.replace(sdma_schedule="oneshot"))
    be.ensure_capacity(rows, cols, torch.bfloat16)
    be.fill_passive_peers()
    y = input_view(be, rows, cols, torch.bfloat16)
    y.normal_()
    side = torch.cuda.Stream(DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(40):
            be.exchange_only(y)  # ~6 ms each at 55 GB/s: outlasts the GEMMs below
    beside = _median_ms(gemm, 20)
    be.check(20000)
    torch.cuda.synchronize()
    out.append({"gemm_alone_ms": round(alone, 3), "gemm_beside_transport_ms": round(beside, 3),
                "contention": round(beside / alone, 3)})
    print(out[-1], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name(DEV)}; mode: 1 GPU, W emulated ranks over PCIe")
    report: dict = {}
    for name, section in (("memops", memops), ("cu_free", cu_free), ("timing", timing)):
        try:
            report[name] = section()
        except Exception as e:  # noqa: BLE001 -- report and go on to the next section
            report[name] = f"FAILED: {type(e).__name__}: {e}"
            print(f"{name}: {report[name]}", flush=True)
        if name == "memops":
            print("memops:", report[name], flush=True)
        if args.json:  # after every section: a later one that hangs keeps the earlier ones
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
