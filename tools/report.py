"""Writing results: the terminal table, JSON, CSV and the PNG plot."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from typing import Iterable, Sequence

from radiance_ar.envs import OVERLAP_PLANS

#: (column title, record key, format) of the terminal table, in order; max_abs_err and
#: the spreads stay in JSON/CSV only (the table is wide enough)
COLUMNS: Sequence[tuple[str, str, str]] = (
    ("backend", "backend", "{}"), ("sched", "schedule", "{}"), ("M", "M", "{}"),
    ("S", "slices", "{}"), ("plan", "plan", "{}"),
    ("gemm ms", "t_gemm_ms", "{:.3f}"), ("ar ms", "t_ar_ms", "{:.3f}"),
    ("serial ms", "t_serial_ms", "{:.3f}"), ("ovl ms", "t_ovl_ms", "{:.3f}"),
    ("bound ms", "bound_ms", "{:.3f}"), ("eff", "efficiency", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"), ("ideal", "speedup_bound", "{:.2f}x"),
    ("hidden", "hidden", "{:.2f}"),
    ("contention", "contention", "contention"), ("slice us", "slice_overhead_us", "{:.1f}"),
    ("wire MiB", "wire_bytes", "mib"), ("bus GB/s", "bus_gbs", "{:.1f}"),
    ("link GB/s", "link_gbs", "{:.1f}"), ("link eff", "link_efficiency", "{:.2f}"),
    ("rel rms", "rel_rms_err", "{:.1e}"), ("ok", "correct", "ok"),
)


def cell(record: dict, key: str, fmt: str) -> str:
    value = record.get(key)
    if value is None:
        return "-"
    if fmt == "mib":
        return f"{value / 2 ** 20:.1f}"
    if fmt == "ok":
        return "yes" if value else "WRONG"
    if fmt == "contention":
        spread = record.get("contention_spread")
        return f"{value:.2f}x" + ("" if spread is None else f"±{spread:.2f}")
    return fmt.format(value)


def unwritable_reason(path: str, is_dir: bool) -> str | None:
    """None if ``path`` (a folder, or a file's path) can be written, else why not.

    Creates the folder (a file's parent folder) and a probe file in it, then removes the
    probe: a run that measures for minutes must not fail at its last step."""
    folder = path if is_dir else (os.path.dirname(path) or ".")
    if not is_dir and os.path.isdir(path):
        return "is a directory, expected a file path"
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


#: the columns of a CPU world: accuracy and bytes only (its timings are not a measurement)
ACCURACY_COLUMNS = tuple(c for c in COLUMNS
                         if c[1] in ("backend", "schedule", "M", "slices", "plan", "wire_bytes",
                                     "rel_rms_err", "correct"))
#: record keys that are timings or derived from them
TIMING_KEYS = ("bound_ms", "efficiency", "speedup", "speedup_bound", "hidden", "contention",
               "contention_spread", "contention_max", "contention_reps", "slice_overhead_us",
               "bus_gbs", "link_gbs", "link_efficiency")
CPU_TIMING_NOTE = ("not a performance measurement: CPU ranks share the machine's cores and "
                   "have no streams, so timings, speedup and contention are measured on GPU "
                   "worlds only")


def without_timings(record: dict) -> dict:
    """``record`` minus every timing and figure derived from one, with a note saying why
    (CPU worlds check correctness; their perf_counter times would read as results)."""
    kept = {k: v for k, v in record.items()
            if not k.startswith("t_") and k not in TIMING_KEYS}
    if "skipped" not in record:
        kept["timings"] = CPU_TIMING_NOTE
    return kept


def table(records: Iterable[dict], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    rows = [[title for title, _, _ in columns]]
    rows += [[cell(r, key, fmt) for _, key, fmt in columns] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, header: dict, records: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"mode": header, "records": records}, f, indent=1)


def write_csv(path: str, records: list[dict]) -> None:
    keys: list[str] = []
    for r in records:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        # Nested values (the timeline summary) as JSON, not as Python reprs.
        writer.writerows({k: json.dumps(v) if isinstance(v, (dict, list)) else v
                          for k, v in r.items()} for r in records)


def write_records(json_path: str, csv_path: str, header: dict, records: list[dict]) -> list[str]:
    """The run as JSON (header + records) and CSV (records); returns both paths."""
    write_json(json_path, header, records)
    write_csv(csv_path, records)
    return [json_path, csv_path]


def slicing(record: dict) -> tuple[int, str]:
    """(S, plan) of a record: the plot's series (the default plan where none is recorded)."""
    return record["slices"], record.get("plan", OVERLAP_PLANS[0])


def slicing_label(cut: tuple[int, str]) -> str:
    """``S=4``, or ``S=4 growing`` for a plan other than the default."""
    slices, plan = cut
    return f"S={slices}" + ("" if plan == OVERLAP_PLANS[0] else f" {plan}")


def write_png(path: str, title: str, records: list[dict],
              baseline: str = "stock (GEMM then AR)") -> None:
    """(a) speedup vs M per backend, (b) contention per backend and M."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_cont) = plt.subplots(1, 2, figsize=(12, 4.5))
    timed = [r for r in records if r.get("speedup") is not None]
    for name in dict.fromkeys(r["backend"] for r in timed):
        for cut in sorted({slicing(r) for r in timed if r["backend"] == name}):
            pts = sorted((r["M"], r["speedup"]) for r in timed
                         if r["backend"] == name and slicing(r) == cut)
            ax_speed.plot(*zip(*pts), marker="o", label=f"{name} {slicing_label(cut)}")
    if timed:
        sizes_m = sorted({r["M"] for r in timed})
        ax_speed.axhline(1.0, color="grey", lw=0.8)
        ax_speed.set(xscale="log", xlabel="M (rows)", ylabel="speedup (serial / overlapped)",
                     title=f"speedup vs {baseline}")
        ax_speed.set_xticks(sizes_m, [str(m) for m in sizes_m])  # no 3x10^2-style ticks
        ax_speed.minorticks_off()
        ax_speed.legend(fontsize=7)
    else:
        ax_speed.text(0.5, 0.5, "speedup is measured on GPU worlds only", ha="center",
                      transform=ax_speed.transAxes)
        ax_speed.set(title="speedup")
    cont = [r for r in records if r.get("contention") is not None]
    names = list(dict.fromkeys(r["backend"] for r in cont))
    sizes = sorted({(r["M"], slicing(r)) for r in cont})
    width = 0.8 / max(1, len(sizes))
    for j, (rows, cut) in enumerate(sizes):
        vals = {r["backend"]: r["contention"] for r in cont if (r["M"], slicing(r)) == (rows, cut)}
        ax_cont.bar([i + j * width for i, n in enumerate(names) if n in vals],
                    [vals[n] for n in names if n in vals], width,
                    label=f"M={rows} {slicing_label(cut)}")
    if cont:
        ax_cont.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(names))], names)
        ax_cont.axhline(1.05, color="green", lw=0.8, ls="--", label="1.05x goal")
        ax_cont.set_ylim(bottom=0.9)
        ax_cont.legend(fontsize=7)
    else:
        ax_cont.text(0.5, 0.5, "contention is measured on GPUs only", ha="center",
                     transform=ax_cont.transAxes)
    ax_cont.set(ylabel="GEMM time beside the AR / GEMM alone", title="contention")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
