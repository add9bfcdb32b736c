#!/usr/bin/env python3
"""The gpu-host session's compare figures beside the emulated world's, and issue 33's targets.

Reads compare_backends JSON files (``report.write_json``: {"mode": header, "records"}),
prints per world, W, backend and M: link efficiency, contention, the op call's device
time and its host time per call per process (``t_ovl_host_ms``: the calling process's
enqueue work; one thread drives every emulated rank, a process its own), then whether
sdma at M = 8192 in the gpu-host world meets the targets (link efficiency >= 0.85,
contention <= 1.05x). Exit status 1 if a file is missing or a record is wrong (a
skipped backend or a missed target is a result, printed, not a failure).

  python tools/host_world_summary.py OUT/compare_host_w2/compare.json ...
"""

from __future__ import annotations

import json
import sys

import report

#: issue 33's targets for sdma at M = 8192 (the emulated world's figures, 2026-12)
TARGET_M, MIN_LINK_EFFICIENCY, MAX_CONTENTION = 8192, 0.85, 1.05
#: the compare table's cells (report.cell), with the world and W of each record's file
COLUMNS = (("world", "world", "{}"), ("W", "W", "{}"), ("backend", "backend", "{}"),
           ("M", "M", "{}"), ("link eff", "link_efficiency", "{:.2f}"),
           ("contention", "contention", "contention"), ("ovl ms", "t_ovl_ms", "{:.3f}"),
           ("host us/call", "t_ovl_host_ms", "us"), ("ok", "correct", "ok"))


def records_of(paths: list[str]) -> tuple[list[dict], list[str]]:
    """Every record of the files, each with its file's world and W, and the problems (a
    file missing or unreadable)."""
    records, problems = [], []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
            continue
        mode = data["mode"]
        records += [{**r, "world": mode.get("world"), "W": mode.get("W")}
                    for r in data["records"]]
    return records, problems


def target_line(r: dict) -> str:
    """Whether a gpu-host sdma record at M = TARGET_M meets issue 33's targets."""
    eff, cont = r.get("link_efficiency"), r.get("contention")
    met = (eff is not None and eff >= MIN_LINK_EFFICIENCY
           and cont is not None and cont <= MAX_CONTENTION)
    return (f"target gpu-host W={r['W']} sdma M={r['M']}: link eff "
            f"{report.cell(r, 'link_efficiency', '{:.2f}')} >= {MIN_LINK_EFFICIENCY}, "
            f"contention {report.cell(r, 'contention', '{:.2f}')} <= {MAX_CONTENTION}: "
            f"{'MET' if met else 'MISSED'}")


def main(argv: list[str]) -> int:
    records, problems = records_of(argv)
    print(report.table(records, COLUMNS))
    for r in records:
        if r["world"] == "gpu-host" and r.get("backend") == "sdma" and r.get("M") == TARGET_M:
            print(target_line(r))
    for p in problems:
        print(f"MISSING {p}")
    # a backend the world does not serve is skipped (no 'correct'), not wrong
    return 1 if problems or not records or any(r.get("correct") is False for r in records) \
        else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
