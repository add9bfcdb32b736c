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

#: issue 33's targets for sdma at M = 8192 (the emulated world's figures, 2026-12)
TARGET_M, MIN_LINK_EFFICIENCY, MAX_CONTENTION = 8192, 0.85, 1.05


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def rows_of(paths: list[str]) -> tuple[list[tuple], list[str]]:
    """(world, W, backend, M, link eff, contention, ovl ms, host us, correct) per record,
    and the problems (a file missing or unreadable)."""
    rows, problems = [], []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
            continue
        mode = data["mode"]
        for r in data["records"]:
            host = r.get("t_ovl_host_ms")
            rows.append((mode.get("world"), mode.get("W"), r.get("backend"), r.get("M"),
                         r.get("link_efficiency"), r.get("contention"), r.get("t_ovl_ms"),
                         None if host is None else host * 1000.0, r.get("correct")))
    return rows, problems


def main(argv: list[str]) -> int:
    rows, problems = rows_of(argv)
    print(f"{'world':<13} {'W':>2} {'backend':<13} {'M':>6} {'link eff':>8} {'contention':>10} "
          f"{'ovl ms':>7} {'host us/call':>12} ok")
    for world, w, backend, m, eff, cont, ovl, host, ok in rows:
        print(f"{world!s:<13} {w!s:>2} {backend!s:<13} {m!s:>6} {_fmt(eff, '.2f'):>8} "
              f"{_fmt(cont, '.2f'):>10} {_fmt(ovl, '.3f'):>7} {_fmt(host, '.0f'):>12} "
              f"{ {True: 'yes', False: 'WRONG', None: 'skipped'}[ok] }")
    for world, w, backend, m, eff, cont, *_ in rows:
        if world == "gpu-host" and backend == "sdma" and m == TARGET_M:
            met = (eff is not None and eff >= MIN_LINK_EFFICIENCY
                   and cont is not None and cont <= MAX_CONTENTION)
            print(f"target gpu-host W={w} sdma M={m}: link eff {_fmt(eff, '.2f')} >= "
                  f"{MIN_LINK_EFFICIENCY}, contention {_fmt(cont, '.2f')} <= {MAX_CONTENTION}: "
                  f"{'MET' if met else 'MISSED'}")
    for p in problems:
        print(f"MISSING {p}")
    # a backend the world does not serve is skipped (its record says why), not wrong
    return 1 if problems or not rows or any(row[-1] is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
