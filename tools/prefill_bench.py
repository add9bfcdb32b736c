#!/usr/bin/env python3
"""What the overlap buys a whole model's prefill, per backend and GEMM producer.

Runs L decoder layers of one tensor-parallel shard of a public model (random weights,
nothing downloaded) over a prefill of T tokens in chunks (vLLM's
max_num_batched_tokens): RMSNorm, QKV (ColumnParallel), causal SDPA attention with
GQA, o_proj through ``radiance::linear_ar``, RMSNorm, gate_up (ColumnParallel),
SiLU-and-mul, down_proj through the op (tools/prefill_stack.py). Each chunk is its own
causal sequence: attention stays within the chunk (no KV of earlier chunks), so the
all-reduce's share here is what a batch of chunk-sized prompts sees, an upper bound
for one long prompt.

Arms: ``off``, each RowParallel linear as the GEMM then the world's unsliced
all-reduce (torchrun and CPU worlds: ``stock``; the emulated world has no vendor
collective: each backend's own unsliced all-reduce), and ``on`` per backend, the op's
sliced pipeline. Every arm is checked before it is timed (tools/prefill_measure.py):
each RowParallel call within the backend's ``rel_rms_bound`` of the float64 sum of its
partials, the same bits on every rank, and the stack output within
``rel_rms_bound * sqrt(2 L)`` of the off arm (per-call errors compound over the 2L
all-reduces). A wrong arm is reported WRONG and not timed.

Reported: prefill tokens/s, speedup vs off, the all-reduce's share of the off arm's
time and the ceiling (every all-reduce hidden under its own GEMM), time per layer type,
the errors. Output: tables, prefill.json, prefill.csv, prefill.png (skipped with a note
without matplotlib). Medians of device events after warm-up, half-IQR spreads.

Worlds (picked like tools/compare_backends.py; the world size is the TP degree):

  torchrun --nproc-per-node 4 tools/prefill_bench.py --model llama-3.1-70b --tp 4
  python tools/prefill_bench.py --model llama-3.1-70b --tp 4      one GPU: 4 emulated ranks
  python tools/prefill_bench.py                                   no GPU: CPU processes at the
                                                                  tiny shape, correctness only

Models: ``--model`` from the table in tools/model_shapes.py (llama-3.1-8b, llama-3.1-70b,
qwen3-32b, tiny), or ``--config path/to/config.json`` (HF-style) with ``--tp``.
Examples:

  python tools/prefill_bench.py --model qwen3-32b --tokens 16384 --chunk 8192 \\
      --backends sdma,sdma_wht6 --out-dir results/prefill-qwen3
  python tools/prefill_bench.py --config ~/models/x/config.json --tp 2 --layers 2
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

from radiance_ar import backends
import baseline
import model_shapes
import prefill_measure
import prefill_report
from compare_backends import start_torchrun_world
import report
from radiance_ar import envs
from radiance_ar.overlap import config as overlap_config
from radiance_ar.envs import BackendSettings
from prefill_stack import GQA_MODES, producer_problem

envs.prepare_cuda_for_emulated_ranks()  # before CUDA starts; main() starts it

#: committed results live here; a run writes here only when --out-dir names it
TRACKED_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: GPU: chunks of 8192 tokens (issue #19's max_num_batched_tokens), two of them; CPU: the
#: tiny shape, two chunks and a remainder (both chunk sizes), ~3 s on 2 cores
DEFAULTS = {"gpu": {"model": "llama-3.1-70b", "tokens": 16384, "chunk": 8192},
            "cpu": {"model": "tiny", "tokens": 160, "chunk": 64}}


def _slices(text: str) -> int | str:
    return "auto" if text == "auto" else _positive(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help=f"built-in config: {', '.join(model_shapes.MODELS)} (default: "
                          f"{DEFAULTS['gpu']['model']} on a GPU, tiny on the CPU)")
    src.add_argument("--config", default=None, help="an HF-style config.json (needs --tp)")
    p.add_argument("--tp", type=_positive, default=None,
                   help="TP degree = world size (default: the model's first listed)")
    p.add_argument("--layers", type=_positive, default=4, help="decoder layers (default 4)")
    p.add_argument("--tokens", type=_positive, default=None, help="prefill tokens T")
    p.add_argument("--chunk", type=_positive, default=None,
                   help="tokens per forward (max_num_batched_tokens)")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends for the on arms (default: every "
                        "registered one; those that cannot serve the world say why)")
    p.add_argument("--producer", default="bf16",
                   help="GEMM producer of every linear (a registered name: "
                        "radiance_ar.overlap.producers.names())")
    p.add_argument("--slices", type=_slices, default="auto",
                   help="slices S of the on arms, or auto: each backend's own at this TP "
                        "degree and each chunk's rows (what the op runs by default; a record "
                        "lists the chunks' counts as 8/4 where they differ); default %(default)s")
    p.add_argument("--baseline", default=None,
                   help="the backend whose off arm every arm is also compared with (column "
                        "'vs base'); default: stock where a vendor collective exists, the "
                        "spin-wait oneshot_wht6 in the emulated world; measured even when "
                        "--backends leaves it out")
    p.add_argument("--gqa", choices=GQA_MODES, default="enable_gqa",
                   help="grouped KV heads through SDPA's enable_gqa, or KV repeated")
    p.add_argument("--reps", type=_positive, default=20, help="timed prefills (median)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed prefills first (default 3; the op captures a shape's graph at "
                        "its second call, so with fewer than 2 the first timed prefill holds "
                        "the captures)")
    p.add_argument("--seed", type=int, default=0, help="weights and inputs")
    p.add_argument("--mode", choices=["auto", "cpu", "emulated"], default="auto",
                   help="auto: torchrun if launched by it, else emulated ranks on a visible "
                        "GPU, else CPU processes")
    p.add_argument("--out-dir", default=None,
                   help="folder for prefill.json/.csv/.png (default ./results; never the "
                        "tracked tools/results/ unless named here)")
    p.add_argument("--no-png", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: expected >= 0")
    if args.config is not None and args.tp is None:
        p.error("--config needs --tp (a config file names no TP degree)")
    if args.out_dir is None:
        args.out_dir = "results"
        if os.path.realpath(args.out_dir) == os.path.realpath(TRACKED_RESULTS):
            p.error("the default ./results here is the tracked tools/results/ folder of "
                    "committed runs: pass --out-dir")
    problem = producer_problem(args.producer)
    if problem is not None:
        p.error(f"--producer: {problem}")
    names = backends.names() if args.backends is None else \
        [b for b in args.backends.split(",") if b]
    try:
        args.backends = [backends.get(b).name for b in names]
    except ValueError as e:
        p.error(f"--backends: {e}")
    if args.baseline is not None:
        try:
            args.baseline = backends.get(args.baseline).name
        except ValueError as e:
            p.error(f"--baseline: {e}")
    return args


def base_backend(args: argparse.Namespace, kind: str) -> str:
    """The backend whose off arm is the base (``--baseline``, else the world's default)."""
    if args.baseline is not None:
        return args.baseline
    return baseline.default_backend({"emulated": "gpu-emulated", "cpu": "cpu-shm"}.get(
        kind, "gpu-symm"))


def world_kind(args: argparse.Namespace) -> str:
    if envs.torchrun_local_rank() is not None and torch.cuda.is_available() \
            and args.mode == "auto":
        return "torchrun"
    if args.mode == "emulated" or (args.mode == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("--mode emulated needs a CUDA/ROCm GPU; none is visible")
        return "emulated"
    return "cpu"


def make_spec(args: argparse.Namespace, kind: str) -> prefill_measure.Spec:
    """ValueError for a model, TP, chunking or setting that cannot run."""
    device = "cpu" if kind == "cpu" else "gpu"
    cfg = (model_shapes.read_config(args.config) if args.config is not None
           else model_shapes.model(args.model or DEFAULTS[device]["model"]))
    tp = args.tp or cfg.tp[0]
    tokens = args.tokens or DEFAULTS[device]["tokens"]
    chunk = args.chunk or DEFAULTS[device]["chunk"]
    return prefill_measure.Spec(
        model_shapes.rank_shapes(cfg, tp), args.layers,
        prefill_measure.chunk_rows(tokens, chunk), args.producer, args.slices,
        tuple(dict.fromkeys([*args.backends, base_backend(args, kind)])), args.reps,
        args.warmup, args.seed, args.gqa, knobs=BackendSettings.from_env())


def header(args: argparse.Namespace, spec: prefill_measure.Spec, kind: str, label: str,
           device: str) -> dict:
    return {"world": kind, "label": label, "W": spec.shapes.tp, "device": device,
            "emulated": kind == "gpu-emulated",
            "model": dataclasses.asdict(spec.shapes.model), "config": args.config,
            "tp": spec.shapes.tp, "gemms_n_k": spec.shapes.gemms(),
            "layers": spec.layers, "tokens": spec.tokens, "chunk": max(spec.chunk_rows),
            "chunk_rows": list(spec.chunk_rows), "slices": spec.slices,
            "producer": spec.producer, "gqa": spec.gqa, "reps": spec.reps,
            "warmup": spec.warmup, "backend_settings": dataclasses.asdict(spec.knobs),
            "chunk_attention": prefill_report.NOTES["chunks"],
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])}


def print_header(hdr: dict) -> None:
    s = hdr["gemms_n_k"]
    print(f"# radiance-ar prefill_bench -- {hdr['label']} -- {hdr['device']}")
    print(f"# {hdr['model']['name']} TP {hdr['tp']}: {hdr['layers']} layers, "
          f"{hdr['tokens']} tokens in chunks {hdr['chunk_rows']}, S = {hdr['slices']}, "
          f"producer {hdr['producer']}; per rank (n, k): "
          + ", ".join(f"{k} {v}" for k, v in s.items()))
    print(f"# torch {hdr['torch']}, cuda {hdr['cuda']}, hip {hdr['hip']}, {hdr['date']}")
    if "timing_note" in hdr:
        print(f"# timing note: {hdr['timing_note']}")
    print(f"# command: {hdr['command']}", flush=True)


def run_torchrun(args, spec: prefill_measure.Spec) -> tuple[dict, list[dict]] | None:
    import torch.distributed as dist

    world, device, shared = start_torchrun_world()
    try:
        if world.size != spec.shapes.tp:
            raise ValueError(f"torchrun started {world.size} ranks but the model runs at TP "
                             f"{spec.shapes.tp}: pass --tp {world.size} or start {spec.shapes.tp}")
        hdr = header(args, spec, world.kind, world.label, torch.cuda.get_device_name(device))
        if shared:
            # A whole prefill timed by one active rank would need passive peers for every
            # op call of the stack (compare_backends times one op call that way); not built.
            hdr["timing_note"] = (f"{envs.torchrun_local_world_size()} ranks share "
                                  f"{torch.cuda.device_count()} GPU(s): every arm verified "
                                  "with every rank active, none timed (ranks time-slice the "
                                  "GPU); time a prefill in the emulated world or one GPU per "
                                  "rank")
        if world.rank == 0:
            print_header(hdr)
        records = prefill_measure.process_world_job(world, spec, timed=not shared)
    finally:
        dist.destroy_process_group()
    return (hdr, records) if world.rank == 0 else None


def run_emulated(args, spec: prefill_measure.Spec) -> tuple[dict, list[dict]]:
    import prefill_emulated

    device = torch.device("cuda", torch.cuda.current_device())
    hdr = header(args, spec, "gpu-emulated", f"1 GPU, {spec.shapes.tp} emulated ranks over PCIe",
                 torch.cuda.get_device_name(device))
    print_header(hdr)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    return hdr, prefill_emulated.emulated_run(spec, device, log)


def run_cpu(args, spec: prefill_measure.Spec) -> tuple[dict, list[dict]]:
    from radiance_ar.harness.cpu_world import CpuWorldPool

    size = spec.shapes.tp
    hdr = header(args, spec, "cpu-shm", f"CPU, {size} processes (gloo + shared memory)",
                 platform.processor() or platform.machine())
    print_header(hdr)
    start = time.monotonic()
    with CpuWorldPool(size) as pool:
        records = pool.run(prefill_measure.process_world_job, spec, timeout_s=3600.0)[0]
    print(f"ran in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return hdr, records


def finish(args, hdr: dict, records: list[dict]) -> None:
    print(prefill_report.summary(hdr, records))
    written = report.write_records(os.path.join(args.out_dir, "prefill.json"),
                                   os.path.join(args.out_dir, "prefill.csv"), hdr, records)
    if not args.no_png:
        png = os.path.join(args.out_dir, "prefill.png")
        if prefill_report.write_png(png, hdr, records):
            written.append(png)
        else:
            print("note: matplotlib is not installed: no PNG (pip install matplotlib)")
    print("wrote " + ", ".join(os.path.abspath(p) for p in written))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        # every RADIANCE_AR_* setting (the backend, the tuning file), before any rank starts
        overlap_config.from_env()
        kind = world_kind(args)
        if kind != "emulated" and args.baseline not in (None, "stock"):
            raise ValueError(f"--baseline {args.baseline}: a {kind} world times one off arm, "
                             "stock's (the vendor collective); other off arms are timed with "
                             "emulated ranks (one GPU, no torchrun)")
        spec = make_spec(args, kind)
    except (ValueError, KeyError) as e:
        print(f"prefill_bench: {e}", file=sys.stderr)
        return 2
    if envs.torchrun_rank() == 0:
        reason = report.unwritable_reason(args.out_dir, True)
        if reason is not None:
            print(f"prefill_bench: cannot write {args.out_dir}: {reason}", file=sys.stderr)
            return 2
    if envs.torchrun_rank() == 0:
        notice = report.overwrite_notice(
            os.path.join(glob.escape(args.out_dir), f"prefill.{ext}")
            for ext in ("json", "csv") + (() if args.no_png else ("png",)))
        if notice is not None:
            print(notice, flush=True)
    if kind == "torchrun":
        result = run_torchrun(args, spec)
        if result is None:
            return 0
        hdr, records = result
    elif kind == "emulated":
        hdr, records = run_emulated(args, spec)
    else:
        hdr, records = run_cpu(args, spec)
    base = base_backend(args, kind)
    baseline.add_prefill_vs_base(records, base)
    hdr["vs_base"] = f"the {base} off arm"
    finish(args, hdr, records)
    return 0 if all(r["correct"] is not False for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
