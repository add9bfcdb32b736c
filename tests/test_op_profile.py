"""tools/op_profile.py's reading of a profiler trace (the GPU run itself is the tool's)."""

import op_profile


def _trace(*events):
    return {"traceEvents": list(events)}


def test_only_the_last_calls_device_events_are_kept_and_timed_from_its_first():
    trace = _trace(
        {"name": "void spin_kernel(long)", "cat": "kernel", "ph": "X", "ts": 100, "dur": 5},
        {"name": "gemm_a<bf16>(int)", "cat": "kernel", "ph": "X", "ts": 110, "dur": 50,
         "args": {"stream": 7}},
        {"name": "void spin_kernel(long)", "cat": "kernel", "ph": "X", "ts": 995, "dur": 5},
        {"name": "Memcpy HtoD (Pinned -> Device)", "cat": "gpu_memcpy", "ph": "X", "ts": 1030,
         "dur": 40, "args": {"stream": 9, "bytes": 4096}},
        {"name": "gemm_a<bf16>(int)", "cat": "kernel", "ph": "X", "ts": 1010, "dur": 50,
         "args": {"stream": 7}},
        {"name": "decode(int)", "cat": "kernel", "ph": "X", "ts": 1060, "dur": 20,
         "args": {"stream": 7}},
        {"name": "cpu op", "cat": "cpu_op", "ph": "X", "ts": 1020, "dur": 500})
    events = op_profile.last_call_events(trace)
    assert [(e["name"], e["stream"], e["start_us"], e["end_us"]) for e in events] == [
        ("gemm_a", 7, 0.0, 50.0), ("Memcpy HtoD (Pinned -> Device)", 9, 20.0, 60.0), ("decode", 7, 50.0, 70.0)]
    assert events[1]["bytes"] == 4096


def test_a_streams_busy_time_counts_overlapping_events_once():
    events = [{"stream": 7, "start_us": 0.0, "end_us": 50.0},
              {"stream": 7, "start_us": 40.0, "end_us": 70.0},
              {"stream": 7, "start_us": 100.0, "end_us": 110.0},
              {"stream": 9, "start_us": 20.0, "end_us": 60.0}]
    streams = op_profile.per_stream(events)
    assert streams["7"] == {"first_us": 0.0, "last_us": 110.0, "busy_us": 80.0}
    assert streams["9"] == {"first_us": 20.0, "last_us": 60.0, "busy_us": 40.0}


def test_a_copy_directions_idle_share_and_overlap_span_every_stream():
    def copy(direction, stream, start, end, nbytes=100):
        return {"name": f"Memcpy {direction} (x -> y)", "kind": "gpu_memcpy", "stream": stream,
                "start_us": start, "end_us": end, "bytes": nbytes}
    events = [copy("HtoD", 8, 0.0, 40.0), copy("HtoD", 9, 30.0, 50.0),  # 10 us at once
              copy("HtoD", 8, 70.0, 100.0),  # after a 20 us gap
              copy("DtoH", 7, 10.0, 20.0, None),
              {"name": "decode", "kind": "kernel", "stream": 8, "start_us": 50.0, "end_us": 70.0}]
    copies = op_profile.per_direction(events)
    assert set(copies) == {"HtoD", "DtoH"}
    # HtoD: union 0-50 and 70-100 = 80 of a 100 us span, 20% idle; 90 us of copies, 10 overlapped
    assert copies["HtoD"] == {"copies": 3, "bytes": 300, "busy_us": 80.0, "span_us": 100.0,
                              "idle_share": 0.2, "overlap_us": 10.0}
    assert copies["DtoH"] == {"copies": 1, "bytes": 0, "busy_us": 10.0, "span_us": 10.0,
                              "idle_share": 0.0, "overlap_us": 0.0}
