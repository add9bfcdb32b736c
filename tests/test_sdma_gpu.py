"""The sdma backend on one GPU: W emulated ranks (each its own stream, buffers and flags
in pinned host memory), the Triton reduce, the bounded missing-peer check, and the proof
that the transport progresses with every SM held."""

import contextlib
import random
import time

# conftest.py sets the CUDA driver variables emulated ranks need (envs.EMULATED_RANKS_CUDA_ENV).
import pytest  # noqa: E402
import torch  # noqa: E402

from radiance_ar import overlap  # noqa: E402
import sdma_jobs as jobs  # noqa: E402
import world_jobs  # noqa: E402
from radiance_ar.envs import BackendSettings  # noqa: E402
from radiance_ar.backends.sdma import SdmaBackend  # noqa: E402
from radiance_ar.transport.signals import PeerTimeoutError  # noqa: E402
from radiance_ar.transport.world import emulated_worlds  # noqa: E402
from radiance_ar.harness.emulated import EmulatedRanks  # noqa: E402
from radiance_ar.overlap.config import OverlapSettings  # noqa: E402
from radiance_ar.overlap.slicing import slice_bounds  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
DT = torch.bfloat16


def _shapes(seed, count):
    plan = random.Random(seed)
    fixed = [(1, 8), (5, 24), (64, 520), (300, 1024)]
    return fixed + [(plan.randint(1, 96), plan.choice([8, 40, 256])) for _ in range(count)]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("schedule", ["oneshot", "twoshot"])
def test_emulated_ranks_exact_identical_and_no_stale_flags(size, schedule, release):
    ranks = EmulatedRanks(size, DEV)
    bes = [SdmaBackend(w, BackendSettings(sdma_schedule=schedule)) for w in ranks.worlds]
    release.extend(bes)
    plan = random.Random(size)
    for call, (rows, cols) in enumerate(_shapes(size * 10 + len(schedule), 50)):
        slices, staged = plan.randint(1, 4), plan.random() < 0.25
        # in a block the slice calls may overlap on the call streams; staged slices share
        # offset 0 of the buffers, so there they must run in turn
        block = plan.random() < 0.5
        xs = [jobs.make_input(7, call, r, rows, cols).to(DEV) for r in range(size)]
        outs = [torch.full((rows, cols), float("nan"), dtype=DT, device=DEV) for _ in bes]
        torch.cuda.synchronize()
        before = [be.pulled_bytes for be in bes]
        ranks.prepare(lambda r: bes[r].ensure_capacity(rows, cols, DT))
        bounds = slice_bounds(rows, slices)

        def step(r):
            src = xs[r] if staged else bes[r].acquire_input_view(rows, cols, DT)
            if not staged:
                src.copy_(xs[r])
            with bes[r].overlapped_calls() if block else contextlib.nullcontext():
                for a, b in zip(bounds[:-1], bounds[1:]):
                    bes[r].all_reduce(src[a:b], outs[r][a:b])

        ranks.each(step)
        for be in bes:
            be.check(5000)
        torch.cuda.synchronize()
        ref = jobs.bits(jobs.reference(7, call, size, rows, cols))
        for r in range(size):
            assert torch.equal(jobs.bits(outs[r].cpu()), ref), (call, rows, cols, r, slices, staged,
                                                                 block)
        pulled = [be.pulled_bytes - b0 for be, b0 in zip(bes, before)]
        nbytes = [(b - a) * cols * 2 for a, b in zip(bounds[:-1], bounds[1:])]
        per_slice = (size - 1) * size if schedule == "oneshot" else 2 * (size - 1)
        assert sum(pulled) == per_slice * sum(nbytes)


@pytest.mark.parametrize("size,schedule", [(2, "oneshot"), (4, "twoshot")])
def test_emulated_ranks_through_the_op(size, schedule, release):
    rows, cols, k, seed = 257, 384, 512, 3
    ref = world_jobs.reference(seed, size, rows, cols, k)
    ranks = EmulatedRanks(size, DEV)
    inputs = world_jobs.device_shards(seed, size, rows, cols, k, DEV)
    for s, plan in ((1, "uniform"), (2, "uniform"), (3, "uniform"), (4, "uniform"),
                    (7, "uniform"), (3, "growing"), (5, "growing")):
        settings = OverlapSettings(True, "sdma", 1, s, BackendSettings(sdma_schedule=schedule),
                                   plan=plan)
        rts = [overlap.build(wd, settings) for wd in ranks.worlds]
        for rt in rts:
            assert rt.backend.schedule == schedule
            release.append(rt.backend)
        ranks.prepare(lambda r: rts[r].backend.ensure_capacity(rows, cols, DT))
        for _ in range(2):
            outs = world_jobs.emulated_forward(ranks, rts, inputs, 5000)
            for r, out in enumerate(outs):
                err = float((out.double().cpu() - ref).norm() / ref.norm())
                assert err < 2 ** -7, (s, r, err)
                assert torch.equal(jobs.bits(out.cpu()), jobs.bits(outs[0].cpu()))
        for rt in rts:
            rt.close()


def test_missing_peer_is_reported_and_the_gpu_released(release):
    settings = BackendSettings(sdma_schedule="oneshot", spin_timeout_ms=300)
    bes = [SdmaBackend(w, settings) for w in emulated_worlds(2, DEV)]
    release.extend(bes)
    for be in bes:
        be.ensure_capacity(8, 64, DT)
    x = torch.randn(8, 64, device=DEV).to(DT)
    out = torch.empty_like(x)
    stream = torch.cuda.Stream(DEV)
    with torch.cuda.stream(stream):
        bes[0].all_reduce(x, out)  # rank 1 never calls
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="peer rank 1 did not post flag 'ready'.*released"):
        bes[0].check()
    assert time.monotonic() - start < 1.5
    stream.synchronize()  # released: returns
    for be in bes:  # back in step: a full call is right again
        be.resync()
    xs = [jobs.make_input(9, 0, r, 8, 64).to(DEV) for r in range(2)]
    outs = [torch.full_like(x, float("nan")) for _ in bes]
    streams = [torch.cuda.Stream(DEV) for _ in bes]
    for be, s, xr, o in zip(bes, streams, xs, outs):
        s.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(s):
            be.all_reduce(xr, o)
    for be in bes:
        be.check()
    torch.cuda.synchronize(DEV)
    ref = jobs.bits(jobs.reference(9, 0, 2, 8, 64))
    assert all(torch.equal(jobs.bits(o.cpu()), ref) for o in outs)


def test_triton_reduce_on_the_gpu_is_bit_exact_with_two_outputs():
    from radiance_ar.backends.kernels.reduce_sum import reduce_sum, reference_reduce_sum

    for w in (1, 2, 3, 8):
        xs = [(torch.randn(100_003) * 64).to(DT) for _ in range(w)]
        ref = torch.empty(100_003, dtype=DT)
        reference_reduce_sum(xs, ref)
        out = torch.full((100_003,), float("nan"), dtype=DT, device=DEV)
        also = torch.full_like(out, float("nan"))
        reduce_sum([x.to(DEV) for x in xs], out, also)
        torch.cuda.synchronize()
        assert torch.equal(jobs.bits(out.cpu()), jobs.bits(ref))
        assert torch.equal(jobs.bits(also.cpu()), jobs.bits(ref))


def test_reduce_by_address_mixes_variants_without_reusing_the_wrong_one():
    """Launches by address (fast_launch) alternate aligned and unaligned operands, sizes
    divisible by 16 or not, and 1: each must run the variant its arguments need."""
    from radiance_ar.streams import current_stream_handle
    from radiance_ar.backends.kernels.reduce_sum import launch_reduce, reference_reduce_sum

    base = [(torch.randn(70_000) * 16).to(DT) for _ in range(4)]
    dev = [x.to(DEV) for x in base]
    for shift, n in [(0, 65_536), (1, 65_536), (0, 1), (3, 4_099), (0, 65_536), (8, 4_096)]:
        xs = [x[shift:shift + n] for x in base]
        ref = torch.empty(n, dtype=DT)
        reference_reduce_sum(xs, ref)
        out = torch.full((n + 8,), float("nan"), dtype=DT, device=DEV)
        launch_reduce([x[shift:].data_ptr() for x in dev], out[shift % 8:].data_ptr(), None, n,
                      DT, current_stream_handle(DEV))
        torch.cuda.synchronize()
        got = out[shift % 8:shift % 8 + n].cpu()
        assert torch.equal(jobs.bits(got), jobs.bits(ref)), (shift, n)
        assert torch.isnan(out[:shift % 8].float()).all(), "wrote before its output"
        assert torch.isnan(out[shift % 8 + n:].float()).all(), "wrote past its output"


def test_the_default_streams_handle_maps_to_the_default_stream():
    """Handle 0 (a caller on the default stream): the engine's and the step trace's stream
    objects must be the default stream itself. ``torch.cuda.ExternalStream(0)`` is a new
    pool stream, on which the publish lane's and the call-end events would not wait for
    the caller's work."""
    from radiance_ar.transport.copy_engine import CopyEngine
    from radiance_ar.streams import current_stream_handle
    from radiance_ar.transport.trace import StepTrace

    with torch.cuda.stream(torch.cuda.default_stream(DEV)):
        handle = current_stream_handle(DEV)
        assert handle == 0
        trace = StepTrace(DEV, {})
        for stream in (CopyEngine(DEV).stream(handle), trace._stream(handle)):
            assert stream == torch.cuda.default_stream(DEV)
            start, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            torch.cuda._sleep(20_000_000)  # about 10 ms
            after.record(stream)
            torch.cuda.synchronize()
            assert start.elapsed_time(after) > 2.0, "the event did not wait for the sleep"


def test_dedicated_streams_are_destroyed_with_their_object_and_the_process_exits_cleanly():
    """Streams made, used and dropped in a child process: each is destroyed when its object
    is collected, and the interpreter exits with status 0. With a weak-reference finalizer
    on the torch stream object (torch's deallocator leaves its weak references dangling),
    the finalizer never ran and GPU test processes died of a segmentation fault at exit."""
    import os
    import subprocess
    import sys

    child = """
import gc, torch
from radiance_ar.transport import copy_engine
destroyed = []
x = torch.ones(1 << 20, device="cuda")
for _ in range(64):
    s = copy_engine.dedicated_stream(torch.device("cuda", 0))
    destroy = s.destroy_call
    s.destroy_call = lambda h, destroy=destroy: (destroyed.append(h), destroy(h))
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.mul_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    del s
gc.collect()
torch.cuda.synchronize()
assert len(destroyed) == 64, len(destroyed)
print("child ok")
"""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, cwd=repo)
    assert done.returncode == 0 and "child ok" in done.stdout, (done.returncode,
                                                                done.stderr[-2000:])


@pytest.mark.parametrize("schedule", ["oneshot", "twoshot"])
def test_a_rank_on_the_default_stream_reduces_what_that_stream_wrote(schedule, release):
    """Rank 0 calls from the default stream, whose input is written behind a ~10 ms
    sleep: the call must publish the written bytes, not what was there before (the
    bindings' flag writes given handle 0 did not wait for the default stream's work)."""
    rows, cols = 64, 256
    bes = [SdmaBackend(w, BackendSettings(sdma_schedule=schedule))
           for w in emulated_worlds(2, DEV)]
    release.extend(bes)
    for be in bes:
        be.ensure_capacity(rows, cols, DT)
    xs = [jobs.make_input(11, 0, r, rows, cols).to(DEV) for r in range(2)]
    outs = [torch.full((rows, cols), float("nan"), dtype=DT, device=DEV) for _ in bes]
    srcs = [be.acquire_input_view(rows, cols, DT) for be in bes]
    srcs[0].fill_(float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(torch.cuda.default_stream(DEV)):
        torch.cuda._sleep(20_000_000)
        srcs[0].copy_(xs[0])
        bes[0].all_reduce(srcs[0], outs[0])
    with torch.cuda.stream(side):
        srcs[1].copy_(xs[1])
        bes[1].all_reduce(srcs[1], outs[1])
    for be in bes:
        be.check(5000)
    torch.cuda.synchronize()
    ref = jobs.bits(jobs.reference(11, 0, 2, rows, cols))
    for r in range(2):
        assert torch.equal(jobs.bits(outs[r].cpu()), ref), r


def test_transport_needs_no_compute_units():
    from radiance_ar.diagnostics import cu_free_check

    results = {r.label.split(" (")[0]: r for r in cu_free_check.standard_checks(DEV)}
    for r in results.values():
        print(r)
    for label in ("H2D copy", "D2H copy", "sdma transport"):
        assert results[label].completed, str(results[label])
        assert results[label].sms_held == results[label].sms, str(results[label])
    be = SdmaBackend(emulated_worlds(2, DEV)[0])
    assert be.uses_compute_units_while_waiting is False, be.compute_unit_note
