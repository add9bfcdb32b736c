"""Writing results: the terminal table, JSON, CSV and the PNG plot."""

from __future__ import annotations

import csv
import glob
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
    ("vs base", "vs_base", "{:.2f}x"),
    ("hidden", "hidden", "{:.2f}"),
    ("contention", "contention", "contention"), ("slice us", "slice_overhead_us", "slice"),
    ("wire MiB", "wire_bytes", "mib"), ("bus GB/s", "bus_gbs", "{:.1f}"),
    ("link GB/s", "link_gbs", "{:.1f}"), ("link eff", "link_efficiency", "{:.2f}"),
    ("rel rms", "rel_rms_err", "{:.1e}"),
    # host time of one op call (the calling process's enqueue work), the world's figure
    # that emulated ranks (one thread for all) and processes compare
    ("host us", "t_ovl_host_ms", "us"), ("ok", "correct", "ok"),
)


def cell(record: dict, key: str, fmt: str) -> str:
    value = record.get(key)
    if fmt == "slice":  # eager slice calls enqueued slower than they ran: no device figure
        return "host" if record.get("slice_overhead_host_bound") else cell(record, key, "{:.1f}")
    if value is None:
        return "-"
    if fmt == "mib":  # 0.05 MiB and less: two decimals, not a bare 0.0
        return f"{value / 2 ** 20:.{1 if value >= 2 ** 20 // 10 else 2}f}"
    if fmt == "us":
        return f"{value * 1000:.0f}"
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


def overwrite_notice(paths: Iterable[str]) -> str | None:
    """``overwriting earlier results in FOLDER: a, b`` for those of ``paths`` (a run's
    output files; glob patterns, their folders escaped with ``glob.escape``) that exist
    already, one line per folder; None when there are none. Said before the run, so
    that earlier results one means to keep can still be moved."""
    found: dict[str, list[str]] = {}
    for pattern in paths:
        for path in sorted(glob.glob(pattern)):
            found.setdefault(os.path.dirname(os.path.abspath(path)), []).append(
                os.path.basename(path))
    lines = [f"overwriting earlier results in {folder}: {', '.join(names)}"
             for folder, names in found.items()]
    return "\n".join(lines) or None


#: the columns of a CPU world: accuracy and bytes only (its timings are not a measurement)
ACCURACY_COLUMNS = tuple(c for c in COLUMNS
                         if c[1] in ("backend", "schedule", "M", "slices", "plan", "wire_bytes",
                                     "rel_rms_err", "correct"))
#: record keys that are timings or derived from them
TIMING_KEYS = ("bound_ms", "efficiency", "speedup", "speedup_bound", "hidden", "contention",
               "contention_spread", "contention_max", "contention_reps", "slice_overhead_us",
               "slice_overhead_host_bound", "bus_gbs", "link_gbs", "link_efficiency", "vs_base")
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


def markdown_table(records: Iterable[dict],
                   columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    """:func:`table`'s cells as a Markdown pipe table (the README's tables)."""
    rows = [[title for title, _, _ in columns]]
    rows += [[cell(r, key, fmt) for _, key, fmt in columns] for r in records]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("---" for _ in columns) + "|")
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


#: the plots' note on a CPU run, whose records carry no timings (``without_timings``)
CPU_PLOT_NOTE = "CPU run: timings were not measured (they need a GPU)"


def write_png(path: str, title: str, records: list[dict],
              baseline: str = "stock (GEMM then AR)", base_arm: str | None = None) -> None:
    """:func:`figure`, saved to ``path``."""
    fig = figure(title, records, baseline, base_arm)
    import matplotlib.pyplot as plt  # after figure() chose the backend

    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(title: str, records: list[dict], baseline: str = "stock (GEMM then AR)",
           base_arm: str | None = None):
    """(a) speedup vs M per backend, (b) contention per backend and M, and where the
    records carry ``vs_base`` (c) every row against the one baseline arm ``base_arm``
    (rows of different backends compare there, not in (a)); for a CPU run (records
    without timings) (a) the accuracy and (b) the wire bytes instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = not (records and all("timings" in r for r in records))
    vs_base = timed and any(r.get("vs_base") is not None for r in records)
    fig, axes = plt.subplots(1, 3 if vs_base else 2, figsize=(17 if vs_base else 12, 4.5))
    left, right = axes[0], axes[1]
    if not timed:
        _accuracy(left, records)
        grouped_bars(right, records, "wire_bytes", 2 ** -20)
        right.set(ylabel="MiB this rank sends per op call", title="wire bytes")
        title = f"{title}\n{CPU_PLOT_NOTE}; shown: accuracy and wire bytes"
    else:
        _per_m_lines(left, records, "speedup", "speedup (serial / overlapped)",
                     f"speedup vs {baseline}")
        _contention(right, records)
    if vs_base:
        _per_m_lines(axes[2], records, "vs_base", "base op time / row op time",
                     f"every row vs {base_arm or 'the base arm'}")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _per_m_lines(ax, records: list[dict], key: str, ylabel: str, title: str) -> None:
    """``key`` against M, one line per (backend, slicing); a grey line at 1."""
    timed = [r for r in records if r.get(key) is not None]
    for name in dict.fromkeys(r["backend"] for r in timed):
        for cut in sorted({slicing(r) for r in timed if r["backend"] == name}):
            pts = sorted((r["M"], r[key]) for r in timed
                         if r["backend"] == name and slicing(r) == cut)
            ax.plot(*zip(*pts), marker="o", label=f"{name} {slicing_label(cut)}")
    if timed:
        sizes_m = sorted({r["M"] for r in timed})
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="M (rows)", ylabel=ylabel, title=title)
        ax.set_xticks(sizes_m, [str(m) for m in sizes_m])  # no 3x10^2-style ticks
        ax.minorticks_off()
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, f"{key} is measured on GPU worlds only", ha="center",
                transform=ax.transAxes)
        ax.set(title=title)


def _contention(ax, records: list[dict]) -> None:
    if grouped_bars(ax, records, "contention"):
        ax.axhline(1.05, color="green", lw=0.8, ls="--", label="1.05x goal")
        ax.set_ylim(bottom=0.9)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "contention is measured on GPUs only", ha="center",
                transform=ax.transAxes)
    ax.set(ylabel="GEMM time beside the AR / GEMM alone", title="contention")


def _accuracy(ax, records: list[dict]) -> None:
    """Each record's relative RMS error as a share of its backend's bound (1: the bound),
    the error itself written on the bar."""
    checked = [dict(r, bound_share=r["rel_rms_err"] / r["rel_rms_bound"]) for r in records
               if r.get("rel_rms_err") is not None and r.get("rel_rms_bound")]
    for bars, errors in grouped_bars(ax, checked, "bound_share", with_values="rel_rms_err"):
        ax.bar_label(bars, [f"{e:.1e}" for e in errors], fontsize=6, rotation=90,
                     padding=2)
    ax.axhline(1.0, color="red", lw=0.8, ls="--", label="bound (rel_rms_bound)")
    ax.set_ylim(0, max([1.3] + [1.15 * r["bound_share"] for r in checked]))
    ax.legend(fontsize=7)
    ax.set(ylabel="relative RMS error / the backend's bound",
           title="accuracy vs a float64 sum (on the bar: the error)")


def grouped_bars(ax, records: list[dict], key: str, scale: float = 1.0, *,
                 with_values: str | None = None) -> list:
    """Bars of ``record[key] * scale``: one group per backend and slicing, one bar per M.
    Returns, per M, (its bars, the records' ``with_values``), for labels; empty when no
    record holds ``key``."""
    held = [r for r in records if r.get(key) is not None]
    groups = list(dict.fromkeys((r["backend"], slicing(r)) for r in held))
    sizes = sorted({r["M"] for r in held})
    width = 0.8 / max(1, len(sizes))
    series = []
    for j, rows in enumerate(sizes):
        of = {(r["backend"], slicing(r)): r for r in held if r["M"] == rows}
        shown = [g for g in groups if g in of]
        bars = ax.bar([i + j * width for i, g in enumerate(groups) if g in of],
                      [of[g][key] * scale for g in shown], width, label=f"M={rows}")
        series.append((bars, [of[g].get(with_values) for g in shown] if with_values else []))
    if held:
        ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(groups))],
                      [f"{name}\n{slicing_label(cut)}" for name, cut in groups], fontsize=8)
        ax.legend(fontsize=7)
    return series
