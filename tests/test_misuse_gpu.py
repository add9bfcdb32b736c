"""No silent wrong result on one GPU: the misuse scenarios with W = 2 emulated ranks
(each its own stream; flags and payloads in pinned host memory), for every backend with
a protocol of its own. The emulated world has no vendor collective, so the mixed-paths
scenario (one rank on the decode path) exists only in CPU worlds (tests/test_misuse.py).
Every call either raises (at the call, or at ``check()``, the host-side bound) or is
right; after ``check()`` and ``resync()`` on every rank a fresh call is right again."""

import pytest
import torch

from radiance_ar import overlap
import world_jobs
from radiance_ar.call_contract import CollectiveError
from radiance_ar.envs import BackendSettings
from radiance_ar.harness.emulated import EmulatedRanks
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.slicing import slice_bounds

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
BOUND_MS = 300.0
N, MIN_M, SLICES = 256, 32, 4
BACKENDS = world_jobs.waiting_backends()


def runtimes(backend):
    settings = OverlapSettings(True, backend, MIN_M, SLICES,
                               BackendSettings(spin_timeout_ms=BOUND_MS))
    ranks = EmulatedRanks(2, DEV)
    rts = [overlap.build(w, settings) for w in ranks.worlds]
    # cuBLAS may load a kernel for a new GEMM shape, which synchronizes the device: with a
    # rank's stream parked on a peer's flag that would hang. Run every slice shape now.
    for rows in (64, 48):
        for k in (32, 64):
            x, w = (t.to(DEV) for t in world_jobs.shard(0, 0, rows, N, k))
            for a, b in zip(slice_bounds(rows, SLICES)[:-1], slice_bounds(rows, SLICES)[1:]):
                torch.mm(x[a:b], w.t())

    def grow(rank):
        rts[rank].backend.ensure_capacity(128, N, torch.bfloat16)
        rts[rank].scratch.get("gemm_out", (128, N), torch.bfloat16, DEV)
        rts[rank].lanes()

    ranks.prepare(grow)
    return rts, ranks.streams


def enqueue(rt, stream, rank, rows, k, seed):
    """One op call of ``rank`` on its stream: the output, or the error the call raised."""
    x, w = (t.to(DEV) for t in world_jobs.shard(seed, rank, rows, N, k))
    stream.wait_stream(torch.cuda.current_stream(DEV))
    try:
        with torch.cuda.stream(stream):
            return overlap.forward(rt, x, w, None, "bf16")
    except CollectiveError as e:
        return e


def settle(rts, outcomes):
    """check() on every rank; a rank whose check raised has its outcome replaced by that
    error (its output is garbage). Returns the outcomes."""
    for r, rt in enumerate(rts):
        try:
            rt.backend.check()
        except CollectiveError as e:
            outcomes[r] = e
    torch.cuda.synchronize(DEV)
    return outcomes


def assert_right_or_raised(outcomes, rows, k, seed, bound):
    ref = world_jobs.reference(seed, 2, rows, N, k)
    for r, o in enumerate(outcomes):
        if not isinstance(o, Exception):
            assert world_jobs.rel_rms(o, ref) <= bound, f"rank {r}: a wrong result, no error"


def resync_and_good_call(rts, streams):
    for rt in rts:
        rt.backend.resync()
    outs = settle(rts, [enqueue(rt, s, r, 64, 32, 99) for r, (rt, s) in
                        enumerate(zip(rts, streams))])
    ref = world_jobs.reference(99, 2, 64, N, 32)
    for r, o in enumerate(outs):
        assert not isinstance(o, Exception), (r, o)
        assert world_jobs.rel_rms(o, ref) <= rts[0].backend.rel_rms_bound, r
    assert torch.equal(outs[0], outs[1])
    for rt in rts:
        rt.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_disagree_on_m_raise_on_both(backend):
    rts, streams = runtimes(backend)
    outcomes = settle(rts, [enqueue(rts[0], streams[0], 0, 64, 32, 3),
                            enqueue(rts[1], streams[1], 1, 48, 32, 3)])
    assert all(isinstance(o, CollectiveError) for o in outcomes), outcomes
    resync_and_good_call(rts, streams)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_late_peer_raises_or_is_right_and_the_next_call_raises(backend):
    rts, streams = runtimes(backend)
    first = [enqueue(rts[0], streams[0], 0, 64, 32, 1)]
    settle(rts[:1], first)  # rank 0 waits out its bound alone
    assert isinstance(first[0], CollectiveError), first
    late = settle(rts, [first[0], enqueue(rts[1], streams[1], 1, 64, 32, 1)])
    assert_right_or_raised(late, 64, 32, 1, rts[0].backend.rel_rms_bound)
    again = settle(rts, [enqueue(rt, s, r, 64, 32, 2) for r, (rt, s) in
                         enumerate(zip(rts, streams))])
    assert all(isinstance(o, CollectiveError) for o in again), again
    resync_and_good_call(rts, streams)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_call_then_another_linear_raises_on_both(backend):
    rts, streams = runtimes(backend)
    skipped = enqueue(rts[1], streams[1], 1, 64, 32, 5)  # rank 0 never makes this call
    outcomes = settle(rts, [enqueue(rts[0], streams[0], 0, 64, 64, 6), skipped])
    assert all(isinstance(o, CollectiveError) for o in outcomes), outcomes
    resync_and_good_call(rts, streams)
