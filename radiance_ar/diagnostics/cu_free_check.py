"""Proof, not assumption, that a transfer runs without compute units (SMs / CUs).

Method: launch spinners (:mod:`radiance_ar.backends.kernels.spin_hold`) that fill EVERY SM to its
thread limit (16 programs of 128 threads per SM = 2048 threads, the per-SM maximum on
Hopper and Ampere) and spin on a host-pinned flag; confirm from the SM ids they record
that every SM holds spinners; issue the transfer on another stream; wait, bounded on
the host, for the transfer's event while the spinners still hold the SMs; only then
release them. A transfer that completes needed no SM; one that does not complete
either needs an SM or queues behind one (both mean: not free of compute units).

What these checks gave on an H200 (which transfers completed with every SM held, and
which did not) is in docs/history.md. The rates under the check are not the copies'
rates: the spinners re-reading a flag in host memory load the same host link. Only
completion is the verdict.

    python -m radiance_ar.diagnostics.cu_free_check [--mib 64] [--timeout-s 2]

prints each check's verdict; exit status 0 only where every transfer completed with EVERY
SM held (a run where the spinners did not reach every SM proves nothing: status 1), 2
without a GPU. The sdma check times one active rank against passive peers, so none of its
waits blocks: it shows the copies and flag operations need no SM, not a blocked wait.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from radiance_ar.transport.copy_engine import CopyEngine

PROGRAMS_PER_SM = 16  # x 128 threads = 2048, the resident-thread limit of an SM
SPIN_READS_PER_S = 1_000_000  # a volatile read of host memory is ~1 us over PCIe


@dataclass
class CuFreeResult:
    label: str
    completed: bool  # the transfer finished while every SM was held
    elapsed_ms: float  # until it finished, or until the bound ran out
    nbytes: int
    sms: int
    sms_held: int  # distinct SMs that reported a spinner before the transfer was issued
    spinners_started: int
    note: str = ""

    @property
    def proven(self) -> bool:
        """The transfer completed while spinners held every SM."""
        return self.completed and self.sms_held == self.sms

    def __str__(self) -> str:
        verdict = ("COMPLETED with every SM held" if self.proven
                   else f"COMPLETED, but only {self.sms_held} of {self.sms} SMs were held: "
                   "proves nothing" if self.completed else "did NOT complete")
        rate = (f", {self.nbytes / self.elapsed_ms / 1e6:.1f} GB/s"
                if self.completed and self.elapsed_ms > 0 else "")
        return (f"{self.label}: {verdict} ({self.nbytes / 2**20:.1f} MiB in "
                f"{self.elapsed_ms:.2f} ms{rate}; SMs held {self.sms_held}/{self.sms}, "
                f"spinners running {self.spinners_started}){' ' + self.note if self.note else ''}")


def _bounded_wait(event: torch.cuda.Event, bound_s: float) -> float | None:
    start = time.monotonic()
    while not event.query():
        if time.monotonic() - start > bound_s:
            return None
        time.sleep(2e-5)
    return (time.monotonic() - start) * 1000.0


def check(issue: Callable[[], int], label: str, device: torch.device,
          timeout_s: float = 2.0) -> CuFreeResult:
    """Run ``issue()`` (enqueues transfers on the current stream, returns bytes) with every
    SM of ``device`` held; see the module doc. Leaves the device idle on return."""
    from radiance_ar.backends.kernels import spin_hold

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cu_free_check: needs a CUDA/ROCm device, got {device}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = sms * PROGRAMS_PER_SM
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    started = torch.zeros(programs, dtype=torch.int32, pin_memory=True)
    spin_stream, copy_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    hold_s = timeout_s + 3.0
    with torch.cuda.stream(spin_stream):
        records_sm = spin_hold.launch(flag, started, int(hold_s * SPIN_READS_PER_S))
        spun = torch.cuda.Event()
        spun.record(spin_stream)
    try:
        # Wait (bounded) until the spinners stop arriving: every resident slot is taken.
        deadline, seen, still = time.monotonic() + 2.0, -1, 0
        while time.monotonic() < deadline and still < 20:
            now = int((started > 0).sum())
            still = still + 1 if now == seen else 0
            seen = now
            time.sleep(5e-3)
        ids = set((started[started > 0] - 1).tolist())
        held = len(ids) if records_sm else (sms if seen >= sms else 0)
        with torch.cuda.stream(copy_stream):
            done = torch.cuda.Event()
            t0 = time.monotonic()
            nbytes = issue()
            done.record(copy_stream)
        elapsed = _bounded_wait(done, timeout_s - (time.monotonic() - t0))
        completed = elapsed is not None
        elapsed = elapsed if completed else (time.monotonic() - t0) * 1000.0
    finally:
        flag[0] = 1  # release the spinners
        if _bounded_wait(spun, hold_s + 2.0) is None:
            raise RuntimeError("cu_free_check: spinners did not stop after release")
        torch.cuda.synchronize(device)
    note = "" if records_sm else "(SM ids not recorded: count of running spinners only)"
    return CuFreeResult(label, completed, elapsed, nbytes, sms, held, seen, note)


def _copy(engine: CopyEngine, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], int]:
    return lambda: engine.copy(dst, src, torch.cuda.current_stream(dst.device if dst.is_cuda
                                                                    else src.device).cuda_stream)


def sdma_transport(device: torch.device, world_size: int = 4, rows: int = 4096,
                   cols: int = 5120) -> tuple[Callable[[], int], object]:
    """The sdma transport of one active emulated rank against passive pre-filled peers:
    publish (D2H), flag write, stream waits on peers' flags, W-1 H2D pulls, flag write."""
    from radiance_ar.backends.sdma import SdmaBackend
    from radiance_ar.transport.world import emulated_worlds

    world = emulated_worlds(world_size, device)[0]
    be = SdmaBackend(world, schedule="oneshot")
    be.ensure_capacity(rows, cols, torch.bfloat16)
    be.fill_passive_peers()
    x = be.acquire_input_view(rows, cols, torch.bfloat16)
    x.normal_()
    torch.cuda.synchronize(device)

    def issue() -> int:
        before = be.pulled_bytes
        be.exchange_only(x)
        return be.pulled_bytes - before + x.numel() * x.element_size()

    return issue, be


def standard_checks(device: torch.device, nbytes: int = 64 << 20,
                    timeout_s: float = 2.0) -> Iterator[CuFreeResult]:
    """H2D, D2H, same-device D2D copies and the sdma emulated transport, each with every
    SM held; yields each result as soon as it is known."""
    device = torch.device(device)
    engine = CopyEngine(device)
    host = torch.randn(nbytes // 4, pin_memory=True)
    dev_a = torch.randn(nbytes // 4, device=device)
    dev_b = torch.empty_like(dev_a)
    yield check(_copy(engine, dev_b, host), "H2D copy (pinned host -> device)", device, timeout_s)
    yield check(_copy(engine, host, dev_a), "D2H copy (device -> pinned host)", device, timeout_s)
    yield check(_copy(engine, dev_b, dev_a), "D2D copy (same device)", device, timeout_s)
    issue, be = sdma_transport(device)
    yield check(issue, "sdma transport (emulated, 1 active + 3 passive ranks)", device, timeout_s)
    be.check()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="bytes of each copy, MiB (default 64)")
    p.add_argument("--timeout-s", type=float, default=2.0,
                   help="how long a transfer may take with every SM held (default 2)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cu_free_check: needs a GPU (it holds every SM with spinners)", file=sys.stderr)
        return 2
    results = []
    for result in standard_checks(torch.device("cuda", torch.cuda.current_device()),
                                  args.mib << 20, args.timeout_s):
        print(result, flush=True)
        results.append(result)
    return 0 if all(r.proven for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
