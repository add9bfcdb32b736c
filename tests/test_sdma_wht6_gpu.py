"""sdma_wht6 on one GPU: W emulated ranks (each its own stream, payloads and flags in pinned
host memory), one-shot and two-shot: the GPU codec's own result bit for bit and the same
bits on every rank, the error bound, the bytes pulled, the op; a rank failing between
two-shot's reduce-scatter and all-gather is reported by ``check()`` within the bound and
the blocked stream released."""

import random
import time

# conftest.py sets the CUDA driver variables emulated ranks need (envs.EMULATED_RANKS_CUDA_ENV).
import pytest  # noqa: E402
import torch  # noqa: E402

from radiance_ar import overlap  # noqa: E402
import world_jobs  # noqa: E402
from radiance_ar import wht6  # noqa: E402
from radiance_ar.call_contract import PeerAbortedError, PeerTimeoutError  # noqa: E402
from radiance_ar.envs import BackendSettings  # noqa: E402
from radiance_ar.backends.sdma_schedule import AUTO_WHT6_TWOSHOT_MIN_BYTES  # noqa: E402
from radiance_ar.backends.sdma_wht6 import SdmaWht6Backend  # noqa: E402
from radiance_ar.harness.emulated import EmulatedRanks  # noqa: E402
from oneshot_jobs import bits, make_input  # noqa: E402
from radiance_ar.overlap.config import OverlapSettings  # noqa: E402
from radiance_ar.overlap.slicing import slice_bounds  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
DT = torch.bfloat16


def codec_result(xs, schedule):
    """The GPU codec's composition for one slice (rows are independent in the format, so
    the whole slice at once equals the backend's shard-by-shard work)."""
    shape = tuple(xs[0].shape)
    summed = wht6.decode_accumulate([wht6.encode(x) for x in xs], shape, DT)
    return summed if schedule == "oneshot" else wht6.decode(wht6.encode(summed), shape, DT)


# (rows, cols): rows < W (empty shards), 768 columns (600-byte payload rows), the model's
# 5120, and 2048 x 5120 (7.8 MiB of payload: auto is two-shot from 3 MiB at W >= 4,
# sdma_schedule; the random slice counts put some of its slices on either side).
SHAPES = [(1, 256), (3, 768), (64, 512), (300, 768), (16, 5120), (2048, 5120)]


def expected_schedule(schedule: str, size: int, numel: int) -> str:
    """The rule of sdma_schedule's doc, written out: auto is two-shot from 4 ranks and
    AUTO_WHT6_TWOSHOT_MIN_BYTES of payload."""
    if schedule != "auto":
        return schedule
    big = wht6.payload_bytes(numel) >= AUTO_WHT6_TWOSHOT_MIN_BYTES
    return "twoshot" if size >= 4 and big else "oneshot"


@pytest.mark.parametrize("size,schedule", [(2, "twoshot"), (3, "twoshot"), (4, "twoshot"),
                                           (4, "auto"), (4, "oneshot")])
def test_emulated_ranks_codec_result_identical_and_wire_bytes(size, schedule, release):
    ranks = EmulatedRanks(size, DEV)
    bes = [SdmaWht6Backend(w, BackendSettings(sdma_schedule=schedule)) for w in ranks.worlds]
    release.extend(bes)
    plan = random.Random(size)
    ran = set()
    for call, (rows, cols) in enumerate(SHAPES):
        slices = plan.randint(1, 4)
        xs = [make_input(7, call, r, rows, cols).to(DEV) for r in range(size)]
        outs = [torch.full((rows, cols), float("nan"), dtype=DT, device=DEV) for _ in bes]
        ranks.prepare(lambda r: bes[r].ensure_capacity(rows, cols, DT))
        before = [be.pulled_bytes for be in bes]
        bounds = list(zip(slice_bounds(rows, slices)[:-1], slice_bounds(rows, slices)[1:]))

        def step(r):
            for a, b in bounds:
                bes[r].all_reduce(xs[r][a:b], outs[r][a:b])

        ranks.each(step)
        for be in bes:
            be.check(5000)
        torch.cuda.synchronize()
        schedules = [bes[0].schedule_for(wht6.payload_bytes((b - a) * cols)) for a, b in bounds]
        assert schedules == [expected_schedule(schedule, size, (b - a) * cols)
                             for a, b in bounds], (call, rows, cols, slices)
        ran.update(schedules)
        want = torch.cat([codec_result([x[a:b] for x in xs], s)
                          for (a, b), s in zip(bounds, schedules)]).cpu()
        exact = sum(x.double().cpu() for x in xs)
        for r, be in enumerate(bes):
            out = outs[r].cpu()
            assert torch.equal(bits(out), bits(want)), (call, rows, cols, r, slices)
            assert world_jobs.rel_rms(out, exact) <= be.rel_rms_bound, (call, r)
            wire = sum(be.wire_bytes((b - a) * cols, size) for a, b in bounds)
            assert be.pulled_bytes - before[r] == wire, (call, r)
    assert ran == ({"oneshot", "twoshot"} if schedule == "auto" else {schedule})


def test_emulated_ranks_twoshot_through_the_op(release):
    rows, cols, k, seed, size = 257, 512, 512, 3, 4
    ref = world_jobs.reference(seed, size, rows, cols, k)
    ranks = EmulatedRanks(size, DEV)
    inputs = world_jobs.device_shards(seed, size, rows, cols, k, DEV)
    for s in (1, 3):
        settings = OverlapSettings(True, "sdma_wht6", 1, s,
                                   BackendSettings(sdma_schedule="twoshot"))
        rts = [overlap.build(wd, settings) for wd in ranks.worlds]
        release.extend(rt.backend for rt in rts)
        # cuBLAS may load a kernel for a new GEMM shape, which synchronizes the device:
        # with a rank's stream parked on a peer's flag that would hang. Run each one now.
        x, w = inputs[0]
        for a, b in zip(slice_bounds(rows, s)[:-1], slice_bounds(rows, s)[1:]):
            torch.mm(x[a:b], w.t())

        def grow(r):
            rts[r].backend.ensure_capacity(rows, cols, DT)
            rts[r].scratch.get("gemm_out", (rows, cols), DT, DEV)
            rts[r].lanes()

        ranks.prepare(grow)
        for _ in range(2):
            outs = world_jobs.emulated_forward(ranks, rts, inputs, 5000)
            for r, out in enumerate(outs):
                assert world_jobs.rel_rms(out, ref) <= rts[r].backend.rel_rms_bound, (s, r)
                assert torch.equal(bits(out.cpu()), bits(outs[0].cpu())), (s, r)
        for rt in rts:
            rt.close()


@pytest.mark.parametrize("fault", ["raise", "silent"])
def test_a_rank_failing_before_its_reduced_shard_is_reported_and_the_gpu_released(
        fault, release):
    """Rank 1's call stops just before it publishes its reduced shard: ``raise`` (its call
    raises; its abort word says so) or ``silent`` (it never posts ``reduced``, as a rank
    that died there). Rank 0's stream is parked on that flag: ``check()`` must raise
    within the bound and release it; rank 1's check then raises too where its call had
    completed (a call a peer gave up on fails on every rank); after resync a call is
    right again."""
    settings = BackendSettings(sdma_schedule="twoshot", spin_timeout_ms=300)
    ranks = EmulatedRanks(2, DEV)
    bes = [SdmaWht6Backend(w, settings) for w in ranks.worlds]
    release.extend(bes)
    rows, cols = 8, 512
    ranks.prepare(lambda r: bes[r].ensure_capacity(rows, cols, DT))
    xs = [make_input(9, 0, r, rows, cols).to(DEV) for r in range(2)]
    outs = [torch.full_like(x, float("nan")) for x in xs]
    publish = bes[1].transport.publish

    def faulty(t, slot, *args, **kwargs):
        if slot != "reduced":
            return publish(t, slot, *args, **kwargs)
        if fault == "raise":
            raise RuntimeError("rank 1 failed before publishing its reduced shard")

    bes[1].transport.publish = faulty
    with ranks.on(0):
        bes[0].all_reduce(xs[0], outs[0])
    try:
        with ranks.on(1):
            bes[1].all_reduce(xs[1], outs[1])
        assert fault == "silent"
    except RuntimeError as e:
        assert fault == "raise" and "rank 1 failed" in str(e)
    del bes[1].transport.publish  # the class's method again
    start = time.monotonic()
    error, pattern = ((PeerAbortedError, "peer rank 1 gave up.*two-shot.*released")
                      if fault == "raise" else
                      (PeerTimeoutError, "peer rank 1 did not post flag 'reduced'.*two-shot"
                                         ".*released"))
    with pytest.raises(error, match=pattern):
        bes[0].check()
    assert time.monotonic() - start < 1.5
    if fault == "silent":
        # rank 1's own waits were met (rank 0 posted its flags), but rank 0 gave up on
        # that call: every rank raises (GpuSignals._raise_if_released_by_a_peer)
        with pytest.raises(PeerAbortedError, match="peer rank 0 gave up on call"):
            bes[1].check(5000)
    else:
        bes[1].check(5000)  # its own call raised already; nothing more to report
    ranks.streams[0].synchronize()  # released: returns
    for be in bes:
        be.resync()
    xs = [make_input(10, 0, r, rows, cols).to(DEV) for r in range(2)]
    outs = ranks.each(lambda r: torch.full_like(xs[r], float("nan")))
    ranks.each(lambda r: bes[r].all_reduce(xs[r], outs[r]))
    for be in bes:
        be.check(5000)
    torch.cuda.synchronize()
    want = codec_result(xs, "twoshot").cpu()
    assert all(torch.equal(bits(o.cpu()), bits(want)) for o in outs)
