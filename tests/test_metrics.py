"""tools/metrics.py, tools/gpu_timing.py's contention record and tools/link.py's copy plan:
the measurement definitions of docs/design.md ('Measurement') against hand arithmetic."""

import contextlib
import math

import pytest
import torch

import gpu_timing
import link
import metrics
from radiance_ar.overlap.slicing import slice_bounds


def test_hidden_fraction_endpoints():
    # perfect overlap: the op takes as long as the longer of the two
    assert metrics.hidden_fraction(2.0, 1.0, 2.0) == pytest.approx(1.0)
    # no overlap: the op takes the sum
    assert metrics.hidden_fraction(2.0, 1.0, 3.0) == pytest.approx(0.0)
    # worse than serial
    assert metrics.hidden_fraction(2.0, 1.0, 3.5) == pytest.approx(-0.5)


def test_speedup_contention_bandwidth():
    assert metrics.speedup(3.0, 2.0) == pytest.approx(1.5)
    assert metrics.contention(1.26, 1.0) == pytest.approx(1.26)
    assert metrics.bus_bandwidth_gbs(80 * 2 ** 20, 1.5) == pytest.approx(55.924, rel=1e-4)


def test_errors_against_float64():
    ref = torch.arange(1, 9, dtype=torch.float64).view(2, 4)
    res = ref.clone()
    res[1, 3] += 0.5
    rel, max_abs = metrics.errors(res, ref)
    assert max_abs == pytest.approx(0.5)
    assert rel == pytest.approx(math.sqrt(0.25 / 8) / math.sqrt((ref ** 2).mean().item()))
    work = torch.full_like(ref, float("nan"))
    assert metrics.errors(res.to(torch.bfloat16), ref, work) == metrics.errors(
        res.to(torch.bfloat16), ref)  # the in-place form computes the same numbers
    for bad_work in (work[:1], work.float(), ref):
        with pytest.raises(ValueError, match="work must be a float64 tensor"):
            metrics.errors(res, ref, bad_work)
    assert metrics.errors(torch.zeros(2, 2), torch.zeros(2, 2)) == (0.0, 0.0)
    with pytest.raises(ValueError, match="reference"):
        metrics.errors(torch.zeros(2, 2), torch.zeros(2, 3))


def test_median_and_spread():
    assert metrics.median_and_spread([3.0]) == (3.0, 0.0)
    # half the IQR by hand: the quartiles of 5 sorted samples at positions 1.5 and 4.5
    # (1-based, between neighbours): (52 - 1.5) / 2; fewer than 4: half the range
    assert metrics.median_and_spread([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, pytest.approx(25.25))
    assert metrics.median_and_spread([1.0, 5.0, 3.0]) == (3.0, 2.0)
    with pytest.raises(ValueError):
        metrics.median_and_spread([])


# ----------------------------------------------------------- pipeline figures (issue: sdma
# at the link's speed)

def test_bound_is_the_longer_lane_plus_one_slice_of_the_other():
    quarters = [0, 2, 4, 6, 8]
    # GEMM-bound: all GEMM slices, then the last AR slice
    assert metrics.bound_ms(4.0, 2.0, quarters) == pytest.approx(4.5)
    # AR-bound: the first GEMM slice, then all AR slices
    assert metrics.bound_ms(2.0, 4.0, quarters) == pytest.approx(4.5)
    # one slice: nothing overlaps, the bound is serial
    assert metrics.bound_ms(2.0, 1.0, [0, 7]) == pytest.approx(3.0)
    # growing slices (1, 2, 4 of 7 parts): AR-bound exposes the first, 1/7 of the GEMM;
    # GEMM-bound the last, 4/7 of the AR
    growing = slice_bounds(7, 3, 1, "growing")
    assert growing == [0, 1, 3, 7]
    assert metrics.bound_ms(1.4, 7.0, growing) == pytest.approx(7.2)
    assert metrics.bound_ms(7.0, 1.4, growing) == pytest.approx(7.8)
    for bad in ([], [0], [1, 4], [0, 3, 3, 5], [0, 4, 2]):
        with pytest.raises(ValueError, match="bounds must rise from 0"):
            metrics.bound_ms(1.0, 1.0, bad)


def test_a_stacks_bound_is_its_serial_time_less_what_each_calls_pipeline_hides():
    quarters = [0, 2, 4, 6, 8]
    # 3 calls of GEMM 2, AR 4 at S = 4 (bound 4.5 each: 1.5 hidden) and 2 calls of GEMM 1,
    # AR 1 at S = 1 (nothing hidden): 100 - 3 x 1.5
    calls = [(3, 2.0, 4.0, 4.0, quarters), (2, 1.0, 1.0, 1.0, [0, 8])]
    assert metrics.stack_bound_ms(100.0, calls) == pytest.approx(95.5)
    # the sliced arm's own all-reduce (a codec: 2.0 against the serial arm's 4.0) saves
    # the difference too: bound max(2 + 0.5, 2 + 0.5) = 2.5 against 6 serial
    assert metrics.stack_bound_ms(100.0, [(1, 2.0, 4.0, 2.0, quarters)]) == pytest.approx(96.5)
    assert metrics.stack_bound_ms(100.0, []) == 100.0


def test_efficiency_slice_overhead_link_efficiency_contention_spread():
    assert metrics.efficiency(4.5, 5.0) == pytest.approx(0.9)
    # 4 slice calls take 0.1 ms more than one call: 25 us per slice
    assert metrics.slice_overhead_us(1.1, 1.0, 4) == pytest.approx(25.0)
    with pytest.raises(ValueError, match="slices"):
        metrics.slice_overhead_us(1.1, 1.0, 0)
    assert metrics.link_efficiency(40.0, 50.0) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="link_gbs must be > 0"):
        metrics.link_efficiency(40.0, 0.0)
    assert metrics.contention_spread(0.02, 2.0) == pytest.approx(0.01)


def test_derived_figures_and_missing_inputs():
    t = {"gemm": 4.0, "ar": 2.0, "serial": 6.0, "ovl": 5.0, "ar_sliced": 2.2}
    d = metrics.derived(t, [0, 2, 4, 6, 8], 2 * 10 ** 9, link_gbs=1000.0)
    assert d["bound_ms"] == pytest.approx(4.5) and d["efficiency"] == pytest.approx(0.9)
    assert d["speedup"] == pytest.approx(1.2) and d["hidden"] == pytest.approx(0.5)
    assert d["speedup_bound"] == pytest.approx(6.0 / 4.5)
    assert d["slice_overhead_us"] == pytest.approx(50.0) and d["t_ar_sliced_ms"] == 2.2
    assert d["bus_gbs"] == pytest.approx(1000.0) and d["link_efficiency"] == pytest.approx(1.0)
    assert d["slice_overhead_host_bound"] is False  # no host time: a CPU-style timer
    d = metrics.derived(dict(t, ar_sliced_host=2.0), [0, 2, 4, 6, 8], 2 * 10 ** 9)
    assert d["slice_overhead_us"] == pytest.approx(50.0) and not d["slice_overhead_host_bound"]
    # each sample is max(device, host): a host median that reaches the median is the host's
    d = metrics.derived(dict(t, ar_sliced_host=2.2), [0, 2, 4, 6, 8], 2 * 10 ** 9)
    assert d["slice_overhead_us"] is None and d["slice_overhead_host_bound"] is True
    assert d["t_ar_sliced_ms"] == 2.2
    d = metrics.derived(dict(t, ar_sliced=None), [0, 2, 4, 6, 8], 2 * 10 ** 9)
    assert d["slice_overhead_us"] is None and d["t_ar_sliced_ms"] is None
    assert d["link_gbs"] is None and d["link_efficiency"] is None


def test_contention_record_is_a_ratio_of_means_over_phases():
    # one phase in five meets the reduce: the mean keeps it, a median would not
    alone = [1.0] * 20
    r = gpu_timing.contention_record((alone, [1.0, 1.0, 1.0, 1.0, 1.5] * 4))
    assert r["contention"] == pytest.approx(1.1) and r["contention_max"] == pytest.approx(1.5)
    assert r["t_gemm_concurrent_ms"] == pytest.approx(1.1) and r["t_gemm_gated_ms"] == 1.0
    # the same GEMM alone is the denominator, phase by phase for the worst one
    r = gpu_timing.contention_record(([2.0, 2.5] * 10, [2.2, 2.5] * 10))
    assert r["contention"] == pytest.approx(4.7 / 4.5) and r["contention_max"] == pytest.approx(1.1)
    r = gpu_timing.contention_record(([2.0] * 20, [2.0, 2.2, 2.4, 2.6, 2.8] * 4))
    # quartiles of [2.0, 2.2, 2.4, 2.6, 2.8] x 4 (20 samples, positions 5.25 and 15.75): 2.2, 2.6
    assert r["t_gemm_concurrent_spread_ms"] == pytest.approx(0.2)
    assert r["contention_spread"] == pytest.approx(0.1)
    assert r["contention_reps"] == 20 == gpu_timing.CONTENTION_MIN_REPS



class _Stream:
    """torch.cuda.Stream as the host sees it: its waits enqueue nothing here."""

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _Event:
    """torch.cuda.Event whose every interval takes 1 ms."""

    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def elapsed_time(self, end):
        return 1.0


def test_contention_repeats_each_start_with_the_barrier_after_the_last_synchronize(monkeypatch):
    # A process world's ranks must start each repeat together: the AR beside the GEMM is a
    # collective, so a rank still in its previous repeat would leave its peers' AR waiting.
    # gpu_timing's loops run here on stand-ins of torch.cuda that log what the host does.
    log = []
    for name, fake in (("Stream", _Stream), ("Event", _Event), ("current_stream", _Stream),
                       ("stream", lambda s: contextlib.nullcontext()),
                       ("synchronize", lambda: log.append("sync"))):
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(gpu_timing, "device_lead", lambda ms: None)
    alone, beside = gpu_timing.contention_times(
        lambda i: log.append("gemm"), lambda j: log.append("ar"), 1.0, 1.0, 20, 3,
        before=lambda: log.append("barrier"))
    assert len(alone) == len(beside) == 20
    repeats = " ".join(log).replace(" barrier", "\nbarrier").split("\n")
    assert len(repeats) == 2 * (20 + 3)  # warm-up included, alone and beside
    assert repeats[0] == "barrier gemm sync"  # alone: no side calls
    # beside: AR calls of 1 ms enough to outlast a 1 ms GEMM started up to 1 ms in: 3
    assert repeats[-1] == "barrier ar ar ar gemm sync"
    assert all(r.startswith("barrier ") and r.endswith(" sync") for r in repeats)


def test_link_copy_plan():
    # sdma one-shot, W=4, S=4: 3 peers x 4 slices, each a quarter of the slice
    assert link.copy_plan(3 * 4096, 4, 4) == (1024, 12)
    assert link.copy_plan(1000, 2, 3) == (333, 3)  # floor: at most the wire bytes move
    with pytest.raises(ValueError, match="world_size >= 2"):
        link.copy_plan(100, 1, 4)
    with pytest.raises(ValueError, match="cannot fill 12 copies"):
        link.copy_plan(11, 4, 4)
    with pytest.raises(TypeError, match="slices must be an int"):
        link.copy_plan(100, 2, 2.0)


def test_link_is_none_on_a_cpu_world():
    from radiance_ar.transport.world import single_world

    assert link.link_gbs(single_world("cpu"), 4096, 4, 10, 1) is None
