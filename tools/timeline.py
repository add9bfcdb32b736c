"""One overlapped op call as the device ran it (``compare_backends.py --timeline``, GPU only).

:func:`record` runs one call of the op's sliced pipeline on a runtime with device events
around each GEMM slice on the side stream and around each slice's AR on the caller's
stream, so the Gantt chart shows where the AR lane waits for the GEMM (the pipeline
fill, a GEMM slower than an AR slice) and where the ARs run back to back. The call is
the op's own: planned and run by :class:`radiance_ar.overlap.plan.CallPlan` as
``radiance::linear_ar`` runs it (eagerly, not a replayed graph), the events recorded by
its :class:`~radiance_ar.overlap.plan.SliceHooks`.

Where the backend traces its steps (:meth:`radiance_ar.backends.interface.Backend.start_trace`:
sdma and sdma_wht6), every wait, copy (per peer and phase), publish and kernel of each
slice's AR is an event too, in the lane of the stream that ran it.

Events are ``{lane, slice, start_ms, end_ms, host_ms}`` (steps also have a ``label``):
device times relative to an event recorded on the caller's stream as the call starts,
and ``host_ms``, when the host enqueued the event's start, on the same origin. A slice
whose AR starts on the device as soon as the host enqueued it (``ar_host_lead_ms`` near
0) waited for the host, not for its GEMM. :func:`summarize` reduces the events to the
record's ``timeline`` key; the writers produce ``timeline.json`` and one Gantt PNG per case.
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import torch

import gpu_timing
import report
from radiance_ar.envs import OVERLAP_PLANS
from radiance_ar.overlap.op import check_inputs
from radiance_ar.overlap.plan import CallPlan, SliceHooks
from radiance_ar.overlap.runtime import OverlapRuntime

GEMM_LANE = "GEMM (side stream)"
AR_LANE = "AR (each slice call: input ready to last step)"
LANES = (GEMM_LANE, AR_LANE)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


#: the lead before a recorded call, in units of the untraced call's host time: a traced
#: call enqueues two more events per step, so it costs the host more than the timed ones
LEAD_HOST_CALLS = 3.0


def record(rt: OverlapRuntime, x: torch.Tensor, weight: torch.Tensor, producer: str,
           lead_ms: float = 0.0) -> tuple[str, list[dict]]:
    """GPU. One op call on ``rt`` with events; returns (path, events). Collective like the
    op (every rank calls it). ``path``: "sliced", or "unsliced" where the op runs GEMM then
    one AR on the caller's stream (M below MIN_M, or a backend that is not pipelined).

    ``lead_ms``: the stream sleeps that long first, so the host enqueues the call ahead of
    the device as in the timed samples (``gpu_timing.event_times``); 0 starts the call on
    an idle device, which then waits for the host at every step it has not reached. Times
    are from the call's device start; a negative ``host_ms`` was enqueued during the sleep."""
    if not x.is_cuda:
        raise ValueError(f"timeline.record: x is on {x.device}; device events need a GPU")
    prod = check_inputs(x, weight, None, producer)
    device = x.device
    spans: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event, float]] = []
    started: dict[tuple[str, int], tuple[torch.cuda.Event, float]] = {}

    def starts(lane: str):
        def hook(s: int) -> None:
            # On the stream current in the hook: the side stream for a sliced GEMM, the
            # caller's for an AR. An AR's start is recorded after its wait for GEMM s:
            # when its input is ready; its end, where the call's steps run on streams of
            # their own (radiance_ar.transport.call_streams), is its last step's (below).
            started[lane, s] = _event(), time.perf_counter()
            started[lane, s][0].record()
            if trace is not None:  # steps enqueued until the next hook belong to slice s
                trace.slice = s
        return hook

    def ends(lane: str):
        def hook(s: int) -> None:
            stop = _event()
            stop.record()
            start, host = started.pop((lane, s))
            spans.append((lane, s, start, stop, host))
        return hook

    hooks = SliceHooks(starts(GEMM_LANE), ends(GEMM_LANE), starts(AR_LANE), ends(AR_LANE))
    torch.cuda.synchronize(device)  # an idle device: the origin, then the lead, run at once
    with rt.one_call_at_a_time():
        backend = rt.backend
        plan = CallPlan.for_call(rt, prod, x, weight)
        trace = backend.start_trace() if plan.sliced else None
        origin, begun = _event(), _event()
        origin.record()
        host_origin = time.perf_counter()
        gpu_timing.device_lead(lead_ms)
        begun.record()
        out = torch.empty((plan.rows, plan.cols), dtype=x.dtype, device=device)
        try:
            plan.run(rt, prod, x, weight, None, out, hooks)
        finally:
            if plan.sliced:
                backend.stop_trace()
    torch.cuda.synchronize(device)
    events = [{"lane": lane, "slice": s, "start_ms": origin.elapsed_time(start),
               "end_ms": origin.elapsed_time(end), "host_ms": (host - host_origin) * 1e3}
              for lane, s, start, end, host in spans]
    if trace is not None:
        steps = trace.spans(origin, host_origin)
        for e in events:
            if e["lane"] == AR_LANE:
                ends = [x["end_ms"] for x in steps if x["slice"] == e["slice"]]
                e["end_ms"] = max([e["end_ms"], *ends])
        events += steps
    slept = origin.elapsed_time(begun)  # the lead: every time is moved back by it
    for e in events:
        for k in ("start_ms", "end_ms", "host_ms"):
            e[k] -= slept
    return ("sliced" if plan.sliced else "unsliced"), events


def lane_spans(events: Sequence[dict], lane: str) -> list[dict]:
    """The events of ``lane`` in slice order (one per slice, slices 0..S-1)."""
    spans = sorted((e for e in events if e["lane"] == lane), key=lambda e: e["slice"])
    if [e["slice"] for e in spans] != list(range(len(spans))):
        raise ValueError(f"timeline: lane {lane!r} has slices {[e['slice'] for e in spans]}, "
                         "expected 0..S-1 once each")
    return spans


def summarize(events: Sequence[dict]) -> dict:
    """The record's ``timeline`` key: per-slice GEMM and AR times, the AR lane's idle gap
    before each slice (slice 0's from the call's start: the pipeline fill), their sum
    (``ar_idle_ms``), the sum without the fill, and the call's span, all in ms."""
    gemm, ar = lane_spans(events, GEMM_LANE), lane_spans(events, AR_LANE)
    if len(gemm) != len(ar) or not ar:
        raise ValueError(f"timeline: {len(gemm)} GEMM and {len(ar)} AR slices; expected the "
                         "same number, at least one")
    gaps, prev_end = [], 0.0
    for e in ar:  # a negative gap: the slice's AR began before the previous one ended
        gaps.append(e["start_ms"] - prev_end)
        prev_end = max(prev_end, e["end_ms"])
    idle = [max(g, 0.0) for g in gaps]
    steps: dict[str, float] = {}
    for e in events:
        if "label" in e:
            kind = e["label"].split(" ")[0]  # wait / pull / publish / reduce / encode ...
            steps[kind] = steps.get(kind, 0.0) + e["end_ms"] - e["start_ms"]
    return {"slices": len(ar),
            "gemm_ms": [e["end_ms"] - e["start_ms"] for e in gemm],
            "ar_ms": [e["end_ms"] - e["start_ms"] for e in ar],
            "ar_gap_ms": gaps, "ar_idle_ms": sum(idle), "ar_idle_after_fill_ms": sum(idle[1:]),
            "ar_host_lead_ms": [e["start_ms"] - e["host_ms"] for e in ar if "host_ms" in e],
            "step_ms": steps, "span_ms": max(e["end_ms"] for e in events)}


def format_slices(entry: dict) -> str:
    """Per slice: GEMM ms, AR ms and the AR lane's idle gap before it, for the terminal."""
    t = summarize(entry["events"])
    lines = [f"timeline {entry['backend']} M={entry['M']} {entry_label(entry)} "
             f"({entry['path']}): "
             f"span {t['span_ms']:.3f} ms, AR idle {t['ar_idle_ms']:.3f} ms "
             f"({t['ar_idle_after_fill_ms']:.3f} after the fill)",
             "  slice  gemm ms  ar ms  ar idle before ms  host lead ms"]
    lead = t["ar_host_lead_ms"] or [float("nan")] * t["slices"]
    for s in range(t["slices"]):
        lines.append(f"  {s:5d}  {t['gemm_ms'][s]:7.3f}  {t['ar_ms'][s]:5.3f}  "
                     f"{t['ar_gap_ms'][s]:17.3f}  {lead[s]:12.3f}")
    if t["step_ms"]:
        lines.append("  device ms per step kind: " + ", ".join(
            f"{k} {v:.3f}" for k, v in sorted(t["step_ms"].items())))
    return "\n".join(lines)


def entry_label(entry: dict) -> str:
    """``S=4``, or ``S=4 growing`` (report.slicing_label of the entry's S and plan)."""
    return report.slicing_label((entry["S"], entry.get("plan", OVERLAP_PLANS[0])))


def png_name(entry: dict) -> str:
    """``timeline_<backend>_M<M>_S<S>[_<plan>].png``"""
    cut = entry_label(entry).replace("=", "").replace(" ", "_")
    return f"timeline_{entry['backend']}_M{entry['M']}_{cut}.png"


def write_json(path: str, header: dict, entries: list[dict]) -> None:
    """``entries``: {backend, M, S, path, events}; each gains its summary."""
    out = [dict(e, summary=summarize(e["events"])) for e in entries]
    with open(path, "w") as f:
        json.dump({"mode": header, "timelines": out}, f, indent=1)


def write_png(path: str, entry: dict, title: str = "") -> None:
    """A Gantt chart of one call: one row per lane, one bar per slice, numbered; below,
    where the backend traced its steps, one row per stream with a bar per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step_lanes = sorted({e["lane"] for e in entry["events"] if "label" in e})
    rows = list(LANES) + step_lanes
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.7 * len(rows)))
    colors = {GEMM_LANE: "tab:blue", AR_LANE: "tab:orange"}
    step_colors = {"wait": "lightgray", "pull": "tab:green", "publish": "tab:purple",
                   "reduce": "tab:red", "encode": "tab:brown", "decode_accumulate": "tab:pink",
                   "fence": "black"}
    for row, lane in enumerate(LANES):
        for e in lane_spans(entry["events"], lane):
            width = e["end_ms"] - e["start_ms"]
            ax.broken_barh([(e["start_ms"], width)], (row - 0.35, 0.7), color=colors[lane],
                           edgecolor="black", linewidth=0.5)
            ax.text(e["start_ms"] + width / 2, row, str(e["slice"]), ha="center",
                    va="center", fontsize=7)
    for row, lane in enumerate(step_lanes, start=len(LANES)):
        for e in entry["events"]:
            if e.get("lane") == lane and "label" in e:
                ax.broken_barh([(e["start_ms"], e["end_ms"] - e["start_ms"])], (row - 0.35, 0.7),
                               color=step_colors.get(e["label"].split(" ")[0], "tab:gray"))
    for kind, color in step_colors.items():
        if step_lanes:
            ax.plot([], [], color=color, linewidth=6, label=kind)
    if step_lanes:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the call's start")
    ax.set_title(title or f"{entry['backend']} M={entry['M']} S={entry['S']} ({entry['path']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(out_dir: str, header: dict, entries: list[dict], png: bool) -> list[str]:
    """timeline.json (and a PNG per entry unless ``png`` is False); returns the paths."""
    paths = [os.path.join(out_dir, "timeline.json")]
    write_json(paths[0], header, entries)
    if png:
        for e in entries:
            paths.append(os.path.join(out_dir, png_name(e)))
            write_png(paths[-1], e, f"{e['backend']} M={e['M']} {entry_label(e)} "
                                    f"({e['path']}) -- {header.get('label', '')}")
    return paths
