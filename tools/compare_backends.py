#!/usr/bin/env python3
"""Compare every all-reduce backend side by side on the same shapes, slicing and buffers.

The project's main job (docs/design.md, 'Measurement'). Where it runs decides the world:

  torchrun --nproc-per-node W tools/compare_backends.py   one GPU per rank (the real thing);
                                                           more ranks than GPUs: ranks share
                                                           GPUs (gloo group, gpu-host world)
  python tools/compare_backends.py                         one GPU: W emulated ranks over PCIe
                                                           no GPU: W CPU processes (gloo + shm)

For every backend x M x slices it verifies the op's result against a float64 reference
on every rank (a wrong backend is reported as wrong and not timed), then times GEMM
alone, AR alone, the AR as S slice calls, GEMM then the unsliced AR (serial: stock's with a GPU per
rank, the backend's own where ranks share a GPU) and the overlap
op, and derives speedup, hidden fraction, the pipeline's bound and efficiency, the
per-slice AR overhead, wire bytes and bus bandwidth; on GPUs also contention and the
raw link's bandwidth (link efficiency). Output: a table, JSON, CSV and a PNG, and with
--timeline (GPU worlds) one op call's per-slice events: timeline.json and Gantt PNGs.
Output paths are checked before anything is measured (rc 2 if one cannot be written).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import os
import platform
import sys
import time

import torch


from radiance_ar import backends  # noqa: E402
from radiance_ar import envs  # noqa: E402
from radiance_ar.overlap import config as overlap_config  # noqa: E402
from radiance_ar.envs import OVERLAP_PLANS, BackendSettings  # noqa: E402
from radiance_ar.overlap.slicing import slice_count  # noqa: E402
from radiance_ar.transport.world import World  # noqa: E402
import baseline  # noqa: E402
from compare_args import DEFAULTS, QUICK, parse_args  # noqa: E402
import gpu_timing  # noqa: E402
import producer_inputs  # noqa: E402
import report  # noqa: E402
import timeline  # noqa: E402
from world_measure import Case, measure  # noqa: E402

envs.prepare_cuda_for_emulated_ranks()  # importing torch does not start CUDA; main() does


def cases(args: argparse.Namespace, device: str, world_kind: str | None = None,
          world_size: int | None = None) -> list[Case]:
    """Every case the options name, ``auto`` slice counts resolved for ``world_size`` ranks
    (default ``args.world``); with ``world_kind``, also the baseline arm's case at each M
    (``args.baseline``, else that world's default: tools/baseline.py)."""
    base = dict(DEFAULTS[device])
    if args.quick:
        base.update(QUICK[device])
    m = args.m or base["m"]
    n, k = args.n or base["n"], args.k or base["k"]
    reps, warmup = args.reps or base["reps"], args.warmup if args.warmup is not None else base["warmup"]
    out = []
    for name in args.backends:
        cls = backends.get(name)
        for rows in m:
            runs: dict[tuple[int, str], None] = {}  # (S, plan), each once, in order
            for setting in (args.slices if cls.pipelined else [1]):
                for plan in (args.plans if cls.pipelined else OVERLAP_PLANS[:1]):
                    s = slice_count(setting, cls, rows, plan, world_size or args.world)
                    # one slice is one plan: the others would repeat it
                    runs[s, baseline.recorded_plan(s, plan)] = None
            for s, plan in runs:
                out.append(Case(name, rows, n, k, s, reps, warmup, seed=rows + s,
                                producer=args.producer, plan=plan,
                                timeline=args.timeline and device == "gpu"))
    if world_kind is not None and out:
        out = baseline.with_arm(out, arm_of(args, world_kind)[0], args.plans[0])
    return out


def arm_of(args: argparse.Namespace, world_kind: str) -> tuple[tuple[str, int], str]:
    """The baseline arm of this run and why it is the base."""
    if args.baseline is not None:
        return args.baseline, "given by --baseline"
    return baseline.default_arm(world_kind)


def header(kind: str, label: str, size: int, device: str) -> dict:
    return {"world": kind, "label": label, "W": size, "device": device,
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            # what the environment set for every backend (the command alone does not say)
            "backend_settings": dataclasses.asdict(BackendSettings.from_env()),
            # GPU timing: per-call time of this many calls behind a first one (gpu_timing)
            "calls_per_sample": 1 if kind == "cpu-shm" else gpu_timing.CALLS_PER_SAMPLE}


def gate_reason(name: str, world) -> str | None:
    return backends.get(name).unsupported_reason(world)


def run_cpu(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    from radiance_ar.harness.cpu_world import CpuWorldPool

    todo = cases(args, "cpu", "cpu-shm")
    hdr = header("cpu-shm", f"CPU, {args.world} processes (gloo + shared memory)", args.world,
                 platform.processor() or platform.machine())
    print_header(hdr)
    if args.timeline:
        print("note: --timeline records device events and needs a GPU world; ignored on the CPU")
    probe = World(0, args.world, torch.device("cpu"), _KindOnly("cpu-shm"), group=_GROUP)
    skipped = [{"backend": c.backend, "M": c.rows, "slices": c.slices, "correct": None,
                "skipped": gate_reason(c.backend, probe)} for c in todo]
    skipped = [r for r in skipped if r["skipped"] is not None]  # listed once, at the end
    todo = [c for c in todo if c.backend not in {r["backend"] for r in skipped}]
    start = time.monotonic()
    print(f"starting {args.world} CPU ranks (gloo + shared memory) ...", file=sys.stderr,
          flush=True)
    records = skipped
    with CpuWorldPool(args.world) as pool:
        pool.run(_ready)
        print(f"started in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        for i, case in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {case.label()} ...",
                  file=sys.stderr, flush=True)
            records.append(pool.run(run_case, case)[0])
    return hdr, records


class _KindOnly:
    """The memory a gate reads of a world: its kind (gates are pure functions of it)."""

    def __init__(self, kind: str):
        self.kind = kind


#: stands for the CPU world's process group in the parent's gate check (gates only ask
#: whether a world has one)
_GROUP = object()


def _ready(world) -> bool:
    return True


def run_case(world, case: Case, one_active: bool = False) -> dict:
    """``one_active``: ranks share a GPU; a backend with a passive-peer mode is timed on
    rank 0 alone against passive peers (``measure_one_active``), others with every rank
    active (``stock``: the group's collective needs every rank)."""
    reason = gate_reason(case.backend, world)
    if reason is not None:
        return {"backend": case.backend, "M": case.rows, "slices": case.slices,
                "correct": None, "skipped": reason}
    if one_active and backends.get(case.backend).waits_on_peers:
        from emulated_measure import measure_one_active

        return measure_one_active(world, case)
    record = measure(world, case)
    if one_active:
        record["timing"] = "every rank active, time-slicing the GPU"
    return record


def print_header(hdr: dict) -> None:
    print(f"# radiance-ar compare_backends -- {hdr['label']}")
    print(f"# device {hdr['device']}, W={hdr['W']}, torch {hdr['torch']}, cuda {hdr['cuda']}, "
          f"hip {hdr['hip']}, {hdr['date']}")
    print(f"# command: {hdr['command']}")
    for key in ("peer_memory_reason", "timing_note"):
        if hdr.get(key):
            print(f"# {key.replace('_', ' ')}: {hdr[key]}")
    if hdr.get("calls_per_sample", 1) > 1:
        print(f"# timing: medians of samples, each the per-call device time of "
              f"{hdr['calls_per_sample']} calls behind a first (device events)", flush=True)


def baseline_of(hdr: dict) -> str:
    """What the speedup is relative to, in a few words, for plot labels."""
    one_active = hdr["world"] == "gpu-emulated" or "timing_note" in hdr  # ranks share a GPU
    return "GEMM then its own unsliced AR" if one_active else "stock (GEMM then AR)"


def finish(args: argparse.Namespace, hdr: dict, records: list[dict]) -> None:
    cpu = hdr["world"] == "cpu-shm"
    hdr["producer"] = args.producer
    arm, why = arm_of(args, hdr["world"])
    hdr["vs_base"] = f"{baseline.label(arm)} ({why})"
    baseline.add_vs_base(records, arm, args.plans[0])
    if cpu:
        records[:] = [report.without_timings(r) for r in records]
    print(report.table([r for r in records if "skipped" not in r],
                       report.ACCURACY_COLUMNS if cpu else report.COLUMNS))
    skipped = {r["backend"]: r["skipped"] for r in records if "skipped" in r}
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    for r in records:
        if "skipped" not in r and not r["correct"]:
            print(f"WRONG {r['backend']} M={r['M']}: rel rms {r['rel_rms_err']:.2e}, identical on "
                  f"ranks: {r['identical_on_ranks']} -- not timed")
    if hdr.get("baseline"):
        print(f"note: {hdr['baseline']}" + (f"; every figure is 1 GPU, {hdr['W']} emulated ranks."
                                            if hdr["world"] == "gpu-emulated" else "."))
    if not cpu:
        print(f"note: vs base = the op time of {hdr['vs_base']} over each row's, at the same M")
    if cpu:
        print(f"note: a CPU world checks every backend's result on every rank; timings are "
              f"{report.CPU_TIMING_NOTE}.")
    timelines = [{"backend": r["backend"], "M": r["M"], "S": r["slices"], "plan": r["plan"],
                  "path": r["timeline"]["path"], "events": r.pop("timeline_events")}
                 for r in records if "timeline_events" in r]
    for entry in timelines:
        print(timeline.format_slices(entry))
    written = report.write_records(args.json or os.path.join(args.out_dir, "compare.json"),
                                   os.path.join(args.out_dir, "compare.csv"), hdr, records)
    if not args.no_png:
        png = os.path.join(args.out_dir, "compare.png")
        report.write_png(png, f"{hdr['label']} -- {hdr['device']} -- {hdr['date']}",
                         [r for r in records if "skipped" not in r], baseline_of(hdr),
                         hdr.get("vs_base"))
        written.append(png)
    if timelines:
        written += timeline.write_all(args.out_dir, hdr, timelines, png=not args.no_png)
    print("wrote " + ", ".join(os.path.abspath(p) for p in written))


def settings_problem() -> str | None:
    """Every RADIANCE_AR_* setting checked once, here, before any rank starts: the one-line
    complaint about the first bad one, or None."""
    try:
        overlap_config.from_env()  # every RADIANCE_AR_* setting; the backend; the tuning file
    except (ValueError, KeyError) as e:
        return f"compare_backends: {e}"
    return None


def output_problem(args: argparse.Namespace) -> str | None:
    """The one-line complaint about the first output path that cannot be written, or None."""
    targets = [(args.out_dir, True)]
    if args.json is not None:
        targets.append((args.json, False))
    for path, is_dir in targets:
        reason = report.unwritable_reason(path, is_dir)
        if reason is not None:
            return f"compare_backends: cannot write {path}: {reason}"
    return None


def output_paths(args: argparse.Namespace) -> list[str]:
    """The files this run writes (glob patterns, for report.overwrite_notice)."""
    out = glob.escape(args.out_dir)
    paths = [glob.escape(args.json or os.path.join(args.out_dir, "compare.json")),
             os.path.join(out, "compare.csv")]
    paths += [] if args.no_png else [os.path.join(out, "compare.png")]
    paths += [os.path.join(out, "timeline.json")] if args.timeline else []
    paths += [os.path.join(out, "timeline_*.png")] if args.timeline and not args.no_png else []
    return paths


def run_torchrun(args: argparse.Namespace) -> tuple[dict, list[dict]] | None:
    import torch.distributed as dist

    world, device, shared = start_torchrun_world()
    hdr = header(world.kind, world.label, world.size, torch.cuda.get_device_name(device))
    hdr["peer_memory_reason"] = world.memory_reason
    if shared:
        hdr["timing_note"] = (f"{envs.torchrun_local_world_size()} ranks share "
                              f"{torch.cuda.device_count()} GPU(s): verified with every rank "
                              "active; timed on rank 0 alone against passive peers (peer "
                              "buffers and flags pre-filled in the shared host memory), as in "
                              "the emulated world; stock (the group's collective) with every "
                              "rank active, time-slicing the GPU (each record's 'timing')")
    hdr["baseline"] = f"serial = {baseline_of(hdr)}"
    if world.rank == 0:
        print_header(hdr)
        run_probe(args, hdr)
    records = [run_case(world, case, one_active=shared)
               for case in cases(args, "gpu", world.kind, world.size)]
    dist.destroy_process_group()
    return (hdr, records) if world.rank == 0 else None


def torchrun_device() -> tuple[torch.device, bool]:
    """This torchrun rank's GPU (local rank modulo the GPUs visible) and whether ranks
    share GPUs (more ranks on this host than GPUs)."""
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", envs.torchrun_local_rank() % gpus)
    return device, envs.torchrun_local_world_size() > gpus


def start_torchrun_world() -> tuple[World, torch.device, bool]:
    """This torchrun rank's world, GPU and whether ranks share GPUs: the process group
    (NCCL, or gloo where ranks share a GPU: NCCL refuses two ranks on one GPU and the host
    collective serves them) and the world over it."""
    import torch.distributed as dist

    from radiance_ar.transport.world import from_process_group

    device, shared = torchrun_device()
    torch.cuda.set_device(device)
    if shared:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=device)
    return from_process_group(device=device), device, shared


def run_emulated(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    from radiance_ar.transport.world import emulated_worlds
    from emulated_measure import measure_emulated

    device = torch.device("cuda", torch.cuda.current_device())
    hdr = header("gpu-emulated", f"1 GPU, {args.world} emulated ranks over PCIe", args.world,
                 torch.cuda.get_device_name(device))
    hdr["baseline"] = "serial = GEMM then the same backend's unsliced AR (no vendor collective)"
    print_header(hdr)
    run_probe(args, hdr)
    probe_world = emulated_worlds(args.world, device)[0]
    todo = cases(args, "gpu", "gpu-emulated")
    records = []
    for i, case in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {case.label()} ...",
              file=sys.stderr, flush=True)
        reason = gate_reason(case.backend, probe_world)
        records.append({"backend": case.backend, "M": case.rows, "slices": case.slices,
                        "correct": None, "skipped": reason} if reason is not None
                       else measure_emulated(case, args.world, device))
    return hdr, records


def run_probe(args: argparse.Namespace, hdr: dict) -> None:
    """GPU: the spin-footprint curve on the largest GEMM of the run (into the header)."""
    if args.no_probe:
        return
    import gpu_timing
    import spin_probe

    base = cases(args, "gpu")[0]
    rows = max(c.rows for c in cases(args, "gpu"))
    x = torch.randn(rows, base.k, device="cuda").to(torch.bfloat16)
    w = torch.randn(base.cols, base.k, device="cuda").to(torch.bfloat16)
    xs = [x] + [torch.randn_like(x) for _ in range(gpu_timing.copies_for(x) - 1)]
    y = torch.empty(rows, base.cols, dtype=torch.bfloat16, device="cuda")

    def gemm(i):
        torch.mm(xs[i % len(xs)], w.t(), out=y)

    curve = spin_probe.spin_footprint(gemm, args.probe_ctas, base.reps, base.warmup)
    hdr["spin_footprint"] = {"M": rows, "N": base.cols, "K": base.k, "curve": curve}
    print(spin_probe.format_curve(curve), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = settings_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    # Only global rank 0 writes; a failure there ends the torchrun job (torchrun stops
    # the other ranks), so the others need not probe the file system themselves.
    if envs.torchrun_rank() == 0:
        problem = output_problem(args)
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    torchrun = (envs.torchrun_local_rank() is not None and torch.cuda.is_available()
                and args.mode == "auto")
    gpu = torchrun or args.mode == "emulated" or (args.mode == "auto" and torch.cuda.is_available())
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--mode emulated needs a CUDA/ROCm GPU; none is visible")
    device = (torchrun_device()[0] if torchrun
              else torch.device("cuda", torch.cuda.current_device()) if gpu
              else torch.device("cpu"))
    problem = producer_inputs.unsupported_reason(args.producer, device)
    if problem is not None:
        print(f"compare_backends: --producer {args.producer}: {problem}", file=sys.stderr)
        return 2
    if envs.torchrun_rank() == 0:
        notice = report.overwrite_notice(output_paths(args))
        if notice is not None:
            print(notice, flush=True)
    if torchrun:
        result = run_torchrun(args)
        if result is None:
            return 0
        hdr, records = result
    elif gpu:
        hdr, records = run_emulated(args)
    else:
        hdr, records = run_cpu(args)
    finish(args, hdr, records)
    return 0 if all(r["correct"] is not False for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
