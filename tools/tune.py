#!/usr/bin/env python3
"""Measure every candidate configuration on this machine and write a tuning file.

The file is what ``RADIANCE_AR_BACKEND=auto`` chooses from (``RADIANCE_AR_TUNING=FILE``;
format and choice: radiance_ar/overlap/tuning.py). For every N, M, backend, S and plan
(and producer) it runs the cases of tools/compare_backends.py, measured by the same code
(world_measure / emulated_measure: the op's result checked on every rank against a
float64 reference, then timed), and keeps per case the op's time. The baseline arm
(tools/baseline.py) is always measured, so the summary compares each choice with it.

  python tools/tune.py --world 2 --m 2048,8192 --out tuning.json     # emulated on a GPU
  python tools/tune.py --from-compare compare.json ... --out t.json  # from compare runs
  python tools/tune.py --summary t.json --markdown                   # the README's table

Every other option is compare_backends' (tools/compare_args.py: --world, --mode, --m,
--k, --backends, --slices, --plans, --producer, --reps, --warmup), with tune's defaults
for --m (the chunk sizes a server sees, below), --slices 1,2,4,8 and --plans
uniform,growing. On a GPU the emulated world's cases time the op alone
(``emulated_measure.measure_emulated(op_only=True)``: one active rank, passive peers).

The file is rewritten before and after every case, so an interrupt (Ctrl-C),
``--max-minutes`` or a kill keeps everything measured so far, and a run killed inside a
case that never returns (the first H200 tune hung at case 346 of 420) leaves a note
naming that case; ``--resume`` then measures only what the file lacks. A CPU world runs
for correctness only: its times mean nothing, and the file says so in its ``note``. The
summary last: per (W, N, M) what ``auto`` chooses for each accuracy class, its time and
the baseline's (``--summary FILE --markdown``: the same as the README's table).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shlex
import sys
import threading
import time

import torch

import compare_backends
import producer_inputs
from compare_args import int_list, parse_args as compare_parse_args
import report
from radiance_ar import envs
from radiance_ar.envs import ACCURACY_CLASSES
from radiance_ar.harness.cpu_world import WorldError
from radiance_ar.overlap import tuning

#: chunked prefill's chunk sizes (vLLM's max_num_batched_tokens settings) from the
#: op's minimum M (RADIANCE_AR_OVERLAP_MIN_M's default) up, and 12288: without it the
#: nearest measured M jumps from 8192 to 16384 at 11585; CPU worlds: sizes 2 cores finish
TUNE_M = {"gpu": [2048, 4096, 8192, 12288, 16384], "cpu": [256, 1024]}
#: every slice count the op's pipeline is measured at (issue 30: S in {1, 2, 4, 8})
TUNE_SLICES = "1,2,4,8"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(tune's own options, the compare_backends options the rest of the line names)."""
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the tuning file to write")
    p.add_argument("--summary", metavar="FILE", default=None,
                   help="measure nothing: print what auto chooses from the tuning file FILE")
    p.add_argument("--markdown", action="store_true",
                   help="with --summary: as the README's Markdown table, with its provenance")
    p.add_argument("--n", type=int_list, default=None,
                   help="output columns N, comma-separated; default compare_backends' N")
    p.add_argument("--producers", default=None,
                   help="GEMM producers, comma-separated (one file for all); default --producer")
    p.add_argument("--worlds", type=int_list, default=None,
                   help="world sizes W, comma-separated (one file for all); default --world")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting cases after this many minutes (what was measured is "
                        "kept); default no limit")
    p.add_argument("--from-compare", nargs="+", default=None, metavar="JSON",
                   help="write the file from compare_backends JSON files instead of measuring")
    p.add_argument("--case-timeout", type=float, default=None, metavar="S",
                   help="GPU: a case still running after S seconds is a hang: exit 3, the "
                        "file naming it (the H200's cases take ~0.6 s; 60 is ample); default "
                        "none. CPU worlds: the pool gives up after S s (default 300): exit 3, the "
                        "file naming the case")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows --out already holds (a run cut short or hung) and "
                        "measure only the cases it lacks")
    p.add_argument("--note", default="",
                   help="a line the file keeps in its note (e.g. a setting the runs forced)")
    own, rest = p.parse_known_args(argv)
    if own.summary is None and own.out is None:
        p.error("--out FILE is required (or --summary FILE)")
    if own.markdown and own.summary is None:
        p.error("--markdown goes with --summary FILE")
    own.producers = None if own.producers is None else [x for x in own.producers.split(",") if x]
    for name in own.producers or []:
        if name not in producer_inputs.known():
            p.error(f"--producers: {name!r}: expected some of {', '.join(producer_inputs.known())}")
    if not any(a.startswith("--slices") for a in rest):
        rest += ["--slices", TUNE_SLICES]
    if not any(a.startswith("--plans") for a in rest):
        rest += ["--plans", ",".join(envs.OVERLAP_PLANS)]
    rest += ["--no-png", "--no-probe"]
    return own, compare_parse_args(rest)


def rows_of(records: list[dict]) -> list[dict]:
    """The tuning rows of compare records: every correct, timed case (skipped and wrong
    cases are left out: nothing was timed)."""
    keys = ("backend", "schedule", "W", "N", "K", "M", "producer", "slices", "plan")
    return [{**{k: r.get(k) for k in keys}, "t_ms": r["t_ovl_ms"],
             "spread_ms": r.get("t_ovl_spread_ms"), "correct": True}
            for r in records if r.get("correct") and r.get("t_ovl_ms")]


def row_key(row: dict) -> tuple:
    """What one case measures: a row of a resumed file and a case to run match by it."""
    return tuple(row[k] for k in ("backend", "W", "N", "M", "producer", "slices", "plan"))


def resumed_rows(path: str, head: dict, k: int) -> tuple[list[dict], str]:
    """``--resume``: the rows of the tuning file at ``path`` and its command (none if it
    does not exist); ``ValueError`` naming it if it is not a tuning file, or if it was
    measured on another device, world, runtime or sdma schedule setting, or with another K,
    than this run (a resume never mixes machines or settings)."""
    try:
        table = tuning.load(path)
    except ValueError:
        if not os.path.exists(path):
            return [], ""
        raise
    theirs = {key: getattr(table, key) for key in ("device", "world", "runtime", "sdma_schedule")}
    ours = {key: head[key] for key in theirs}
    if theirs != ours:
        raise ValueError(f"--resume {path}: measured on {theirs}, this run is {ours}; "
                         "resume on the machine and world that wrote it, or write a new file")
    other_k = sorted({r.K for r in table.rows} - {k})
    if other_k:
        raise ValueError(f"--resume {path}: rows of K = {other_k}, this run's K is {k}")
    with open(path) as f:  # the rows as written, to be written back
        return json.load(f)["rows"], table.command


def header_of(hdr: dict, command: str, note: str = "") -> dict:
    """A tuning file's header from a compare_backends header."""
    runtime = f"torch {hdr['torch']}, cuda {hdr['cuda']}, hip {hdr['hip']}"
    # the backend knobs the environment set away from their defaults change the times,
    # and the command alone does not show them
    set_knobs = {k: v for k, v in hdr.get("backend_settings", {}).items()
                 if v != getattr(envs.BackendSettings(), k)}
    if set_knobs:
        note = (f"backend knobs: {', '.join(f'{k}={v}' for k, v in set_knobs.items())}. "
                + note).strip()
    if hdr["world"] == "cpu-shm":
        note = ("a CPU world (gloo + shared memory): every result was checked, but the "
                "times mean nothing; tune on the GPU machine that serves. " + note).strip()
    return {"device": hdr["device"], "runtime": runtime, "world": hdr["world"],
            "measured_at": hdr["date"], "command": command, "note": note,
            "sdma_schedule": hdr.get("backend_settings", {}).get("sdma_schedule", "auto")}


def summary(table: tuning.TuningTable, markdown: bool = False) -> str:
    """Per (W, N, M, producer): what auto chooses for each accuracy class, its time and
    the baseline arm's (``tuning.choose``, which carries the base). ``markdown``: the
    README's table (a pipe table under the file's provenance) instead of the console's."""
    out = []
    for W, N, M, producer in sorted({(r.W, r.N, r.M, r.producer) for r in table.rows}):
        row = {"W": W, "N": N, "M": M, "producer": producer}
        for acc in ACCURACY_CLASSES:
            try:
                c = tuning.choose(table, W, N, M, producer, acc)
            except ValueError:
                row[acc] = "(none measured)"
                continue
            row.update({acc: c.label(), f"{acc} ms": c.t_ms, "base": c.base,
                        "base ms": c.base_ms,
                        f"{acc} vs base": None if c.base_ms is None else c.base_ms / c.t_ms})
        out.append(row)
    cols = [("W", "W", "{}"), ("N", "N", "{}"), ("M", "M", "{}"), ("producer", "producer", "{}")]
    for acc in ACCURACY_CLASSES:
        cols += [(acc, acc, "{}"), ("ms", f"{acc} ms", "{:.3f}"),
                 ("vs base", f"{acc} vs base", "{:.2f}x")]
    cols += [("base", "base", "{}"), ("base ms", "base ms", "{:.3f}")]
    if markdown:
        lines = [f"Measured on {table.device} ({table.world}; {table.runtime}) at "
                 f"{table.measured_at}: `{table.command}`"]
        if table.note:
            lines.append(f"Note: {table.note}")
        return "\n".join(lines + ["", report.markdown_table(out, cols)])
    lines = [f"# tuning file {table.path}: {table.device}, {table.world}, {table.measured_at}"]
    if table.note:
        lines.append(f"# note: {table.note}")
    return "\n".join(lines + [report.table(out, cols)])


#: the exit status of a run stopped by --case-timeout
HUNG_RC = 3


def case_watchdog(seconds: float, label: str, out: str) -> threading.Timer:
    """Started before a case, cancelled after it: a case still running after ``seconds``
    is taken for a hang (an emulated peer parked in a device wait never returns, and
    nothing in this process can wake it), so the run exits with :data:`HUNG_RC`; the
    file, written before the case, holds every case before it and names this one."""
    def give_up() -> None:
        print(f"\ntune: {label} still running after --case-timeout {seconds:g} s (hung?); "
              f"{out} holds the cases before it and names it; exiting with {HUNG_RC}",
              file=sys.stderr, flush=True)
        os._exit(HUNG_RC)

    dog = threading.Timer(seconds, give_up)
    dog.daemon = True
    dog.start()
    return dog


def progress(i: int, total: int, label: str, start: float) -> None:
    """``[####....] i/total label, elapsed, ETA`` on stderr (ETA: the mean case so far)."""
    elapsed = time.monotonic() - start
    eta = elapsed / (i - 1) * (total - i + 1) if i > 1 else None
    bar = "#" * (20 * (i - 1) // total)
    print(f"[{bar:<20}] {i}/{total} {label}  {elapsed:5.0f} s"
          + (f", ETA {eta:4.0f} s" if eta is not None else ""), file=sys.stderr, flush=True)


def measure(own: argparse.Namespace, args: argparse.Namespace, command: str) -> int:
    """Run every case (see module doc), writing the file after each; rc 1 if one was wrong,
    3 if the run was cut short (--max-minutes, Ctrl-C: the file's note says INCOMPLETE)."""
    gpu = args.mode == "emulated" or (args.mode == "auto" and torch.cuda.is_available())
    device = "gpu" if gpu else "cpu"
    # every setting and producer checked before the first case, not at the first case of
    # the shape it breaks (after hours of others on a GPU)
    problem = compare_backends.settings_problem()
    where = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    for producer in own.producers or [args.producer]:
        reason = producer_inputs.unsupported_reason(producer, where)
        if problem is None and reason is not None:
            problem = f"tune: --producers {producer}: {reason}"
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    args.m = args.m or TUNE_M[device]
    kind = "gpu-emulated" if gpu else "cpu-shm"
    todo = []  # (W, case), shape by shape: a run cut short loses whole shapes, not a backend
    for size, n, producer in itertools.product(own.worlds or [args.world], own.n or [None],
                                               own.producers or [args.producer]):
        args.world, args.n, args.producer = size, n, producer
        # one seed per shape: its cases share their inputs (world_measure.shard's cache)
        todo += [(size, dataclasses.replace(c, seed=c.rows))
                 for c in compare_backends.cases(args, device, kind)]
    todo.sort(key=lambda wc: (wc[0], wc[1].cols, wc[1].producer, wc[1].rows))
    if gpu:
        from radiance_ar.transport.world import emulated_worlds
        from emulated_measure import measure_emulated
        dev = torch.device("cuda", torch.cuda.current_device())
        hdr = compare_backends.header(kind, "", args.world, torch.cuda.get_device_name(dev))

        def run(size, case):
            if size not in probes:  # the gates read a world; one per size
                probes[size] = emulated_worlds(size, dev)[0]
            reason = compare_backends.gate_reason(case.backend, probes[size])
            return ({"backend": case.backend, "skipped": reason} if reason is not None
                    else measure_emulated(case, size, dev, op_only=True))
    else:
        from radiance_ar.harness.cpu_world import CpuWorldPool
        hdr = compare_backends.header(kind, "", args.world, "cpu")

        def run(size, case):
            if size not in pools:
                pools[size] = CpuWorldPool(size)
            return pools[size].run(compare_backends.run_case, case,
                                   timeout_s=own.case_timeout or 300.0)[0]
    pools: dict = {}
    probes: dict = {}
    head = header_of(hdr, command, own.note)
    k = todo[0][1].k if todo else args.k
    kept, earlier = resumed_rows(own.out, head, k) if own.resume else ([], "")
    done = {row_key(r) for r in kept}
    todo = [(size, c) for size, c in todo if row_key(
        {"backend": c.backend, "W": size, "N": c.cols, "M": c.rows, "producer": c.producer,
         "slices": c.slices, "plan": c.plan}) not in done]
    if kept:
        head["note"] = (f"{head['note']} " if head["note"] else "") + (
            f"{len(kept)} rows kept from an earlier run of this file (--resume; its command: "
            f"{earlier}).")
        print(f"tune: --resume: {len(kept)} rows kept from {own.out}, {len(todo)} cases left",
              file=sys.stderr)
    records, start, stopped = [], time.monotonic(), None

    def write(running: str) -> None:
        """The file as measured so far; ``running``: the case now running, said in the
        note, so a run killed in a case that never returns (a hang) names it."""
        rows = kept + rows_of(records)
        if rows:
            note = (f"{head['note']} " if head["note"] else "") + running
            tuning.dump(own.out, {**head, "note": note.strip()}, rows)

    try:
        for i, (size, case) in enumerate(todo, 1):
            if own.max_minutes is not None and time.monotonic() - start > 60 * own.max_minutes:
                stopped = f"--max-minutes {own.max_minutes:g} reached after {i - 1} of {len(todo)} cases"
                break
            label = case.label() + f" W={size} N={case.cols}"
            progress(i, len(todo), label, start)
            write(f"INCOMPLETE: case {i} of {len(todo)} ({label}) was running when this was "
                  "written; tools/tune.py --resume measures the rest")
            # one process drives every emulated rank: a hung case never returns (the CPU
            # world's pool raises after --case-timeout itself)
            dog = case_watchdog(own.case_timeout, label, own.out) if gpu and own.case_timeout \
                else None
            records.append(run(size, case))
            if dog is not None:
                dog.cancel()
            write("")
    except KeyboardInterrupt:
        stopped = f"interrupted after {len(records)} of {len(todo)} cases"
    except WorldError as e:  # a CPU world's case over --case-timeout, or a rank that died
        stopped = f"case {len(records) + 1} of {len(todo)} ({label}) failed: {e}"
    finally:
        for pool in pools.values():
            pool.close()
    if stopped:  # the file says so: a table cut short must not read as a whole one
        write(f"INCOMPLETE: {stopped}; tools/tune.py --resume measures the rest")
    elapsed = time.monotonic() - start
    print(f"# {len(records)} of {len(todo)} cases measured in {elapsed:.0f} s "
          f"({elapsed / max(len(records), 1):.2f} s per case)")
    if stopped:
        print(f"note: {stopped}; {own.out} holds what was measured", file=sys.stderr)
    wrong = [r for r in records if r.get("correct") is False]
    for r in wrong:
        print(f"WRONG {r['backend']} M={r['M']} S={r['slices']}: rel rms {r['rel_rms_err']:.2e} -- "
              "not timed, not in the file")
    if not kept + rows_of(records):
        print("tune: nothing was measured correct; no file written", file=sys.stderr)
        return 1
    print(summary(tuning.load(own.out)))
    return 1 if wrong else 3 if stopped else 0


def from_compare(own: argparse.Namespace, command: str) -> int:
    """Write the file from compare_backends JSON files of one machine and world."""
    rows, heads = [], []
    for path in own.from_compare:
        try:
            with open(path) as f:
                data = json.load(f)
            heads.append(data["mode"])
            rows += rows_of(data["records"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"tune: --from-compare {path}: not a compare_backends JSON file "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    worlds = {(h["device"], h["world"]) for h in heads}
    if len(worlds) != 1:
        print(f"tune: --from-compare files come from different machines or worlds: {worlds}",
              file=sys.stderr)
        return 2
    keys = [row_key(r) for r in rows]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    problem = ("no correct, timed case (a CPU world times nothing)" if not rows
               else f"cases measured twice: {twice[:3]}" if twice
               else f"rows of several K: {sorted({r['K'] for r in rows})}"
               if len({r["K"] for r in rows}) > 1 else None)
    if problem is not None:
        print(f"tune: --from-compare: {problem}; {own.out} left as it was", file=sys.stderr)
        return 2
    note = (f"{own.note} " if own.note else "") + "converted from " + "; ".join(
        f"{h['date']}: {h['command']}" for h in heads)
    tuning.dump(own.out, header_of(heads[-1], command, note), rows)
    print(summary(tuning.load(own.out)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, args = parse_args(argv)
    command = shlex.join(["tune.py"] + argv)
    if own.summary is not None:
        try:
            print(summary(tuning.load(own.summary), own.markdown))
        except ValueError as e:
            print(f"tune: {e}", file=sys.stderr)
            return 2
        return 0
    problem = report.unwritable_reason(own.out, False)
    if problem is not None:
        print(f"tune: cannot write {own.out}: {problem}", file=sys.stderr)
        return 2
    if own.from_compare:
        return from_compare(own, command)
    try:
        return measure(own, args, command)
    except ValueError as e:  # a bad --resume file, named
        print(f"tune: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    envs.prepare_cuda_for_emulated_ranks()
    sys.exit(main())
