"""tools/timeline.py from synthetic events: the per-slice summary (gaps, idle time, the
host's lead, device time per step kind), its JSON, PNG and terminal lines."""

import json

import pytest
import torch

import timeline

STEP_LANE = "AR steps (caller stream)"


def synthetic_events(slices=3, gemm=1.0, ar=1.5):
    """A GEMM-lane and an AR-lane span per slice, as a sliced call would produce them, and
    two traced steps per AR (a wait of 0.1 ms, a pull for the rest). The host enqueues
    every GEMM at once and each AR 0.2 ms before it starts, except the last: that one the
    device starts as soon as the host enqueued it (a host-bound slice)."""
    events, ar_end = [], 0.0
    for s in range(slices):
        g0 = 0.1 + s * gemm
        events.append({"lane": timeline.GEMM_LANE, "slice": s, "start_ms": g0,
                       "end_ms": g0 + gemm, "host_ms": 0.01 * s})
        a0 = max(g0 + gemm, ar_end)
        ar_end = a0 + ar
        events.append({"lane": timeline.AR_LANE, "slice": s, "start_ms": a0, "end_ms": ar_end,
                       "host_ms": a0 - (0.0 if s == slices - 1 else 0.2)})
        events.append({"lane": STEP_LANE, "label": "wait ready 1", "slice": s,
                       "start_ms": a0, "end_ms": a0 + 0.1, "host_ms": a0})
        events.append({"lane": STEP_LANE, "label": "pull 1", "slice": s,
                       "start_ms": a0 + 0.1, "end_ms": ar_end, "host_ms": a0})
    return events


def test_timeline_summary_gaps():
    t = timeline.summarize(synthetic_events())
    assert t["slices"] == 3
    assert t["gemm_ms"] == pytest.approx([1.0] * 3) and t["ar_ms"] == pytest.approx([1.5] * 3)
    # slice 0 waits for the fill (0.1 + 1.0); then the AR-bound lane never idles
    assert t["ar_gap_ms"] == pytest.approx([1.1, 0.0, 0.0])
    assert t["ar_idle_ms"] == pytest.approx(1.1)
    assert t["ar_idle_after_fill_ms"] == pytest.approx(0.0)
    assert t["span_ms"] == pytest.approx(1.1 + 4.5)
    assert t["ar_host_lead_ms"] == pytest.approx([0.2, 0.2, 0.0])
    assert t["step_ms"] == pytest.approx({"wait": 0.3, "pull": 4.2})
    with pytest.raises(ValueError, match="expected 0..S-1"):
        events = synthetic_events()
        last_ar = [e for e in events if e["lane"] == timeline.AR_LANE][-1]
        timeline.summarize([e for e in events if e is not last_ar] + [dict(last_ar, slice=0)])


def test_timeline_json_png_and_terminal_lines(tmp_path):
    entry = {"backend": "sdma", "M": 2048, "S": 3, "path": "sliced",
             "events": synthetic_events(gemm=2.0, ar=1.0)}
    wants_png = pytest.importorskip("matplotlib") is not None
    paths = timeline.write_all(str(tmp_path), {"W": 4}, [entry], png=wants_png)
    data = json.loads((tmp_path / "timeline.json").read_text())
    got = data["timelines"][0]
    assert data["mode"] == {"W": 4} and got["events"] == entry["events"]
    assert got["summary"]["ar_gap_ms"] == pytest.approx([2.1, 1.0, 1.0])
    assert set(got["events"][0]) == {"lane", "slice", "start_ms", "end_ms", "host_ms"}
    png = tmp_path / "timeline_sdma_M2048_S3.png"
    assert paths == [str(tmp_path / "timeline.json"), str(png)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = timeline.format_slices(entry).splitlines()
    assert len(lines) == 2 + 3 + 1 and "AR idle 4.100 ms" in lines[0]
    assert lines[2].split() == ["0", "2.000", "1.000", "2.100", "0.200"]
    assert lines[-1].split(": ")[1] == "pull 2.700, wait 0.300"


def test_timeline_record_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="device events need a GPU"):
        timeline.record(None, torch.zeros(2, 2), torch.zeros(2, 2), "bf16")


def test_timeline_summary_counts_overlapping_slice_calls_as_no_idle():
    """Slice calls on call streams of their own can overlap: a negative gap, no idle."""
    events = [{"lane": timeline.GEMM_LANE, "slice": s, "start_ms": s, "end_ms": s + 1.0}
              for s in range(2)]
    events += [{"lane": timeline.AR_LANE, "slice": 0, "start_ms": 1.0, "end_ms": 3.0},
               {"lane": timeline.AR_LANE, "slice": 1, "start_ms": 2.5, "end_ms": 4.0}]
    t = timeline.summarize(events)
    assert t["ar_gap_ms"] == pytest.approx([1.0, -0.5])
    assert t["ar_idle_ms"] == pytest.approx(1.0) and t["ar_idle_after_fill_ms"] == 0.0
