"""The gpu-host world: W = 2 and 4 real processes (a gloo group), rank r on GPU r modulo
the GPUs visible (one GPU: every rank on cuda:0), peer buffers and flags in job-private
shared host memory registered with each process's CUDA runtime. Every backend through
the op against float64, the same bits on every rank; the call contract across processes
(late peer, M mismatch, skipped call, killed peer: every surviving rank raises within the
bound, nothing left behind); 1000 calls with memory flat."""

import os

import pytest
import torch

import host_world_jobs as jobs
import misuse_jobs
import world_jobs
from radiance_ar.harness.cpu_world import CpuWorldPool

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # CpuWorldPool: a GPU per rank where there are enough, else shared
SERVED = ["stock", "sdma", "sdma_wht6", "oneshot_wht6"]
WAITING = world_jobs.waiting_backends()
COLLECTIVE_ERRORS = {"PeerTimeoutError", "CollectiveMismatchError", "PeerAbortedError",
                     "ResyncRequiredError"}
BOUND_MS = 300.0
# How long a surviving rank may take to raise: the bound, the release of its stream
# (GpuSignals._drain) and the time slices of W processes sharing one GPU.
RAISE_WITHIN_S = 3 * BOUND_MS / 1000 + 2.0
N, K, MIN_M, SLICES = 512, 128, 64, 4


def host_pool(size: int) -> CpuWorldPool:
    return CpuWorldPool(size, collective_timeout_s=60, device=DEVICE, peer_memory="host")


@pytest.fixture(scope="module")
def pools():
    made: dict[int, CpuWorldPool] = {}

    def get(size: int) -> CpuWorldPool:
        if size not in made or made[size].closed:
            made[size] = host_pool(size)
        return made[size]

    yield get
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("size", [2, 4])
def test_the_world_is_gpu_host_with_registered_shared_buffers(pools, size):
    res = pools(size).run(jobs.probe_job)
    for rank, r in enumerate(res):
        assert r["kind"] == "gpu-host", r
        assert r["label"] == f"{size} processes, GPU buffers staged in shared host memory"
        assert r["reason"] == "RADIANCE_AR_PEER_MEMORY=host"
        assert r["pinned"] == [True] * size and r["device_address_is_host"] == [True] * size
        assert r["seen"] == list(range(1, size + 1)) and all(r["whole"]), (rank, r)
        for name in SERVED:
            assert r["served"][name] is None, (name, r["served"][name])


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("backend", SERVED)
@pytest.mark.parametrize("graphs", ["off", "auto"])
def test_every_backend_through_the_op_matches_float64_with_the_same_bits(pools, size, backend,
                                                                         graphs):
    # sliced calls (M >= MIN_M) of two shapes, a repeat (auto: captured, then replayed)
    # and a decode-path call (M < MIN_M: the group's collective)
    calls = [(256, K, 1), (192, 64, 2), (256, K, 3), (256, K, 4), (16, K, 5)]
    res = pools(size).run(jobs.op_job, backend, graphs, calls, N, MIN_M, SLICES)
    for i, (rows, k, seed) in enumerate(calls):
        ref = jobs.layer_reference(seed, size, rows, N, k)
        for rank, r in enumerate(res):
            rel = world_jobs.rel_rms(r["outs"][i], ref)
            assert rel <= r["bound"], (rank, i, rel)
            assert torch.equal(r["outs"][i], res[0]["outs"][i]), (rank, i)
    if graphs == "auto" and backend in ("sdma", "sdma_wht6"):  # the backends that replay
        assert all(r["replays"] > 0 for r in res), [r["replays"] for r in res]
    if backend == "stock":
        assert "gloo" in res[0]["collective"] and "host round trip" in res[0]["collective"]


def _check_contract(res, must_raise_on):
    for rank, r in enumerate(res):
        for i, c in enumerate(r["calls"]):
            if "error" in c:
                assert c["error"] in COLLECTIVE_ERRORS, (rank, i, c)
                assert c["seconds"] < RAISE_WITHIN_S, (rank, i, c)
            else:
                assert c["rel"] <= c["bound"], f"rank {rank} call {i}: a wrong result, no error"
        if rank in must_raise_on:
            assert any("error" in c for c in r["calls"]), f"rank {rank} raised nothing"
    world_jobs.assert_right_on_every_rank([r["after_resync"] for r in res])


@pytest.mark.parametrize("backend", WAITING)
def test_a_late_peer_raises_and_later_calls_refuse_until_resync(pools, backend):
    res = pools(2).run(misuse_jobs.late_peer_job, backend, BOUND_MS)
    _check_contract(res, must_raise_on=(0, 1))
    assert res[0]["calls"][0]["error"] == "PeerTimeoutError", res[0]["calls"][0]
    # The stream-wait protocol's late rank reads rank 0's abort word and refuses; the
    # kernel-spin protocol (oneshot_wht6) has no abort word: its late rank may get a right
    # result, then waits out the bound for rank 0, which refuses (the emulated world's
    # contract too: tests/test_misuse_gpu.py)
    later = (("ResyncRequiredError", "PeerAbortedError") if backend != "oneshot_wht6"
             else COLLECTIVE_ERRORS)
    for r in res:
        assert r["calls"][1]["error"] in later, r["calls"]
    if backend == "oneshot_wht6" and "error" not in res[1]["calls"][0]:
        assert "peer rank 0" in res[1]["calls"][1]["message"], res[1]["calls"]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("backend", WAITING)
def test_ranks_that_disagree_on_m_raise_on_every_rank(pools, size, backend):
    # rank 0 calls with M = 64, every other rank with M = 48
    res = pools(size).run(misuse_jobs.disagree_on_m_job, backend, BOUND_MS)
    _check_contract(res, must_raise_on=range(size))


@pytest.mark.parametrize("backend", WAITING)
def test_a_skipped_call_raises_on_every_rank(pools, backend):
    res = pools(2).run(misuse_jobs.skipped_call_job, backend, BOUND_MS, False)
    _check_contract(res, must_raise_on=(0, 1))


# A pool per case (a killed rank breaks its world): the kernel-spin protocol and the
# stream-wait transport (sdma's; sdma_wht6 shares it with its codec kernels in the flow).
@pytest.mark.parametrize("size,backend", [(2, "oneshot_wht6"), (4, "oneshot_wht6"),
                                          (4, "sdma"), (2, "sdma_wht6"), (4, "sdma_wht6")])
def test_a_killed_peer_raises_on_every_survivor_within_the_bound_and_leaves_nothing(size,
                                                                                    backend):
    with host_pool(size) as pool:
        res = pool.run(misuse_jobs.killed_peer_job, backend, BOUND_MS, dying=(size - 1,),
                       timeout_s=180)
        assert pool.closed
    assert res[-1] is None
    for rank, r in enumerate(res[:-1]):
        (call,) = r["calls"]
        assert call.get("error") in ("PeerTimeoutError", "PeerAbortedError"), (rank, call)
        assert call["seconds"] < RAISE_WITHIN_S, (rank, call)
        assert f"peer rank {size - 1} is dead (the process has exited)" in call["message"], (
            rank, call)
    assert not os.path.exists(res[0]["dir"]), os.listdir(res[0]["dir"])


def test_a_call_that_stalls_unchecked_stops_its_process_through_the_watchdog():
    # Inside a serving engine nothing calls check(): rank 0 blocks on the device behind a
    # call its peer never makes, and only its watchdog can end that. The limit is above a
    # first call's kernel compilation (up to 6.1 s here), which the watchdog cannot tell
    # from a missing peer.
    limit_s = 20.0
    with host_pool(2) as pool:
        procs = list(pool._procs)
        res = pool.run(misuse_jobs.unchecked_stall_job, "sdma", limit_s, dying=(0,),
                       timeout_s=limit_s + 120)
    assert res[0] is None and procs[0].exitcode == -6, procs[0].exitcode  # SIGABRT
    seen = res[1]
    assert seen["dead"] == [0] and seen["abort"] > 0, seen  # the abort word came first
    assert limit_s <= seen["after_s"] < limit_s + 15, seen
    assert seen["dir"] and not os.path.exists(seen["dir"])  # rank 0's stop removed it


@pytest.mark.parametrize("size,backend", [(2, "sdma"), (2, "oneshot_wht6"), (4, "sdma_wht6")])
def test_a_thousand_calls_keep_memory_flat(pools, size, backend):
    rows, cols, k, calls = 256, N, K, 1000
    res = pools(size).run(jobs.soak_job, backend, calls, rows, cols, k, 20, timeout_s=240)
    ref = jobs.layer_reference(calls, size, rows, cols, k)  # the last call's inputs
    out_bytes = rows * cols * 2  # the last output, held when memory is read afterwards
    for rank, r in enumerate(res):
        b, a = r["before"], r["after"]
        assert a["peer_allocations"] == b["peer_allocations"], (rank, b, a)
        assert a["peer_bytes"] == b["peer_bytes"], (rank, b, a)
        assert a["gpu_allocated"] - b["gpu_allocated"] <= out_bytes, (rank, b, a)
        assert a["gpu_reserved"] == b["gpu_reserved"], (rank, b, a)
        assert a["resident"] - b["resident"] < 16 << 20, (rank, b, a)
        assert world_jobs.rel_rms(r["out"], ref) <= r["bound"], rank
        assert torch.equal(r["out"], res[0]["out"]), rank
