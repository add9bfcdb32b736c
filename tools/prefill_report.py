"""The prefill benchmark's output: terminal tables, JSON, CSV and a PNG.

Record keys (one record per arm; JSON ``{"mode": header, "records": [...]}``, the same
keys in the CSV):

| key | meaning |
|---|---|
| `arm`, `backend`, `slices` | `off`: GEMM then the world's unsliced all-reduce; `on`: the op, S slices (a string such as `8/4` where `auto` cut the chunks differently: each chunk's S in order) |
| `tokens_per_s`, `t_prefill_ms`, `t_prefill_spread_ms` | the whole prefill (every chunk, every layer): tokens / median time; half the IQR |
| `speedup` | on arms: the off arm's median / this arm's (emulated: the same backend's off arm) |
| `vs_base` | every arm: the base backend's off arm's median / this arm's (`--baseline`; default `stock`, in the emulated world the spin-wait `oneshot_wht6`; `mode.vs_base` names it) |
| `t_<component>_ms` | the component's time summed over layers and chunks (events between components, same repeats) |
| `t_ar_total_ms`, `ar_share` | off arm: the all-reduce alone at each chunk size x its calls, and its share of the off prefill |
| `t_hideable_ms`, `ceiling_speedup` | off arm: per RowParallel call min(its GEMM alone, its all-reduce alone), summed; off / (off - hideable): the most hiding this off arm's all-reduce can give; an on arm whose all-reduce is faster (a codec) can pass it. "GEMM alone" is the producer's GEMM on inputs prepared outside the timer (an fp8 producer's activation quantize is not in it, unlike compare_backends' `t_gemm_ms`) |
| `bound_ms`, `speedup_bound`, `efficiency` | on arms: the prefill at efficiency 1 (the off arm less, per RowParallel call, its GEMM + all-reduce alone minus its pipeline's bound with the slices this arm cut, `metrics.stack_bound_ms`; the on backend's own all-reduce alone); off / bound (column `ideal`: the most these slices can give, so a target above it cannot be met with them); bound / this arm (column `eff`) |
| `call_rel_rms_max`, `call_bound` | the worst RowParallel call vs the float64 sum of its partials; the backend's bound |
| `stack_rel_rms_vs_off`, `stack_bound` | on arms: the stack output vs the off arm's; bound x sqrt(2 x layers), with an fp8-activation producer max(bound, sqrt(bound x 2^-3)) x sqrt(2 x layers) |
| `identical_on_ranks`, `finite`, `correct` | same bits on every rank; no NaN/Inf; every check passed (else not timed) |
| `skipped`, `timing_skipped` | why this backend has no arm here, or is not timed here |
"""

from __future__ import annotations

import report
from prefill_stack import COMPONENTS

#: component -> column title
COMPONENT_TITLES = {"norms": "norms", "qkv": "qkv", "attention": "attention",
                    "o_proj_ar": "o_proj+AR", "mlp_gemms": "gate_up+act",
                    "down_proj_ar": "down+AR"}
NOTES = {
    "cpu": ("CPU world: correctness only. Timings are " + report.CPU_TIMING_NOTE + "."),
    "chunks": ("each chunk is its own causal sequence (attention within the chunk): with "
               "the KV of earlier chunks, attention costs more and the all-reduce's share "
               "is lower"),
    "emulated": ("1 GPU, W emulated ranks over PCIe: verified with W active ranks, timed "
                 "with one active rank against W-1 passive peers; off = GEMM then the same "
                 "backend's unsliced all-reduce (no vendor collective)"),
}


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ok(r: dict) -> str:
    return "yes" if r.get("correct") else "WRONG"


def headline_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        spread = r.get("t_prefill_spread_ms")
        rows.append({
            "arm": r["arm"], "backend": r["backend"], "S": str(r.get("slices", "-")),
            "tokens/s": _fmt(r.get("tokens_per_s"), "{:,.0f}"),
            "prefill ms": ("-" if r.get("t_prefill_ms") is None
                           else f"{r['t_prefill_ms']:.2f}±{spread:.2f}"),
            "speedup": _fmt(r.get("speedup"), "{:.3f}x"),
            "vs base": _fmt(r.get("vs_base"), "{:.3f}x"),
            "AR ms": _fmt(r.get("t_ar_total_ms"), "{:.2f}"),
            "AR share": _fmt(r.get("ar_share"), "{:.1%}"),
            "ceiling": _fmt(r.get("ceiling_speedup"), "{:.3f}x"),
            "ideal": _fmt(r.get("speedup_bound"), "{:.3f}x"),
            "eff": _fmt(r.get("efficiency"), "{:.2f}"),
            "call err": _fmt(r.get("call_rel_rms_max"), "{:.1e}"),
            "stack err": _fmt(r.get("stack_rel_rms_vs_off"), "{:.1e}"),
            "ok": _ok(r)})
    return rows


def component_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        row = {"arm": r["arm"], "backend": r["backend"]}
        for c in COMPONENTS:
            ms = r.get(f"t_{c}_ms")
            row[COMPONENT_TITLES[c]] = ("-" if ms is None
                                        else f"{ms:.2f} ({ms / r['t_prefill_ms']:.0%})")
        rows.append(row)
    return rows


def accuracy_rows(records: list[dict]) -> list[dict]:
    return [{"arm": r["arm"], "backend": r["backend"], "S": str(r.get("slices", "-")),
             "call err": _fmt(r.get("call_rel_rms_max"), "{:.1e}"),
             "call bound": _fmt(r.get("call_bound"), "{:.1e}"),
             "stack err": _fmt(r.get("stack_rel_rms_vs_off"), "{:.1e}"),
             "stack bound": (_fmt(r.get("stack_bound"), "{:.1e}")
                             if r.get("stack_rel_rms_vs_off") is not None else "-"),
             "same bits": "yes" if r.get("identical_on_ranks") else "no", "ok": _ok(r)}
            for r in records]


def text_table(rows: list[dict]) -> str:
    if not rows:
        return "(no arm ran)"
    columns = [(title, title, "{}") for title in rows[0]]
    return report.table(rows, columns)


def summary(hdr: dict, records: list[dict]) -> str:
    """Everything the terminal shows after the run."""
    ran = [r for r in records if "skipped" not in r]
    timed = [r for r in ran if r.get("t_prefill_ms") is not None]
    out = []
    if hdr["world"] == "cpu-shm":
        out += [text_table(accuracy_rows(ran)), "note: " + NOTES["cpu"]]
    else:
        out += [text_table(headline_rows(ran))]
        if timed:
            out += ["", "time per layer type, ms over the whole prefill (share of the arm's "
                        "prefill):", text_table(component_rows(timed))]
    for r in records:
        if "skipped" in r:
            out.append(f"skipped {r['backend']}: {r['skipped']}")
        elif "timing_skipped" in r and r["arm"] == "on":
            out.append(f"not timed {r['backend']}: {r['timing_skipped']}")
        elif not r["correct"]:
            out.append(f"WRONG {r['arm']} {r['backend']}: worst call {r['call_rel_rms_max']:.2e} "
                       f"(bound {r['call_bound']:.1e}), stack {r['stack_rel_rms_vs_off']} "
                       f"(bound {r['stack_bound']:.1e}), same bits {r['identical_on_ranks']}, "
                       f"finite {r['finite']}{', ' + r['error'] if r.get('error') else ''} "
                       "-- not timed")
    if hdr.get("emulated"):
        out.append("note: " + NOTES["emulated"])
    out.append("note: " + NOTES["chunks"])
    return "\n".join(out)


def write_png(path: str, hdr: dict, records: list[dict]) -> bool:
    """:func:`figure`, saved to ``path``; False (nothing written) when matplotlib is not
    installed."""
    try:
        import matplotlib  # noqa: F401  (figure() imports it again)
    except ImportError:
        return False
    fig = figure(hdr, records)
    import matplotlib.pyplot as plt  # after figure() chose the backend

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figure(hdr: dict, records: list[dict]):
    """Tokens/s per arm and each arm's time per layer type; on a CPU run, which times
    nothing, each arm's errors against their bounds instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if r.get("t_prefill_ms") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    title = (f"{hdr['model']['name']} TP {hdr['tp']}, {hdr['layers']} layers, "
             f"{hdr['tokens']} tokens in chunks {hdr['chunk_rows']} -- {hdr['label']} -- "
             f"{hdr['device']} -- {hdr['date']}")
    if hdr["world"] == "cpu-shm":
        checked = [r for r in records if r.get("call_rel_rms_max") is not None]
        _errors(left, checked, "call_rel_rms_max", "call_bound",
                "worst RowParallel call vs the float64 sum of its partials")
        _errors(right, [r for r in checked if r.get("stack_rel_rms_vs_off") is not None],
                "stack_rel_rms_vs_off", "stack_bound", "stack output vs the off arm's")
        title += f"\n{report.CPU_PLOT_NOTE}; shown: each arm's errors against their bounds"
    elif timed:
        _throughput(left, right, timed, hdr.get("vs_base"))
    else:
        for ax in (left, right):
            ax.text(0.5, 0.5, "no arm was timed", ha="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


def _labels(records: list[dict]) -> list[str]:
    return [f"{r['backend']}\n{r['arm']}" for r in records]


def _throughput(ax_rate, ax_parts, timed: list[dict], base_arm: str | None = None) -> None:
    labels = _labels(timed)
    bars = ax_rate.bar(labels, [r["tokens_per_s"] for r in timed],
                       color=["#999999" if r["arm"] == "off" else "#3070b0" for r in timed])
    for bar, r in zip(bars, timed):
        text = "\n".join(f"{r[key]:.3f}x{what}" for key, what in (("speedup", ""),
                                                                  ("vs_base", " base"))
                         if r.get(key) is not None)
        if text:
            ax_rate.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                             ha="center", va="bottom", fontsize=7)
    base = f"; 'base': vs {base_arm}" if base_arm else ""
    ax_rate.set(ylabel="prefill tokens/s", title=f"prefill throughput (speedup vs off{base})")
    bottom = [0.0] * len(timed)
    for c in COMPONENTS:
        values = [r[f"t_{c}_ms"] for r in timed]
        ax_parts.bar(labels, values, bottom=bottom, label=COMPONENT_TITLES[c])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_parts.set(ylabel="ms over the prefill", title="time per layer type")
    ax_parts.legend(fontsize=7)
    for ax in (ax_rate, ax_parts):
        ax.tick_params(axis="x", labelsize=7)


def _errors(ax, records: list[dict], key: str, bound: str, what: str) -> None:
    """Each arm's error ``key`` as a share of its ``bound`` (1: the bound), the error
    itself on the bar."""
    shares = [r[key] / r[bound] for r in records]
    bars = ax.bar(_labels(records), shares,
                  color=["#999999" if r["arm"] == "off" else "#3070b0" for r in records])
    ax.bar_label(bars, [f"{r[key]:.1e}" for r in records], fontsize=7, padding=2)
    ax.axhline(1.0, color="red", lw=0.8, ls="--", label="bound")
    ax.set_ylim(0, max([1.3] + [1.15 * v for v in shares]))
    ax.set(ylabel="relative RMS error / its bound", title=what)
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
