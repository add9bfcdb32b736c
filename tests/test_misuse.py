"""No silent wrong result: misuse scenarios in real CPU worlds (2 gloo processes), for
every backend with a protocol of its own. Each call either raises or is right; every
affected rank raises; after resync() a fresh call is right on every rank."""

import time

import pytest
import torch

import misuse_jobs
import world_jobs
from radiance_ar import backends
from radiance_ar.envs import BackendSettings

BOUND_MS = 200.0
BACKENDS = world_jobs.waiting_backends()
COLLECTIVE_ERRORS = {"PeerTimeoutError", "CollectiveMismatchError", "PeerAbortedError",
                     "ResyncRequiredError"}


def check(res, must_raise_on=(0, 1)):
    for rank, r in enumerate(res):
        for i, c in enumerate(r["calls"]):
            if "error" in c:
                assert c["error"] in COLLECTIVE_ERRORS, (rank, i, c)
            else:
                assert c["rel"] <= c["bound"], f"rank {rank} call {i}: a wrong result, no error"
        if rank in must_raise_on:
            assert any("error" in c for c in r["calls"]), f"rank {rank} raised nothing"
    world_jobs.assert_right_on_every_rank([r["after_resync"] for r in res])


@pytest.fixture(scope="module")
def pool(cpu_world):
    return cpu_world(2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_late_peer_raises_on_both_ranks_and_later_calls_refuse_until_resync(pool, backend):
    res = pool.run(misuse_jobs.late_peer_job, backend, BOUND_MS)
    check(res)
    assert res[0]["calls"][0]["error"] == "PeerTimeoutError", res[0]["calls"][0]
    assert res[1]["calls"][0]["error"] == "PeerAbortedError", res[1]["calls"][0]
    for r in res:  # the second call: refused on both, whatever the first said
        assert r["calls"][1]["error"] == "ResyncRequiredError", r["calls"][1]
        assert "resync()" in r["calls"][1]["message"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_disagree_on_m_raise_a_mismatch_naming_both_views(pool, backend):
    res = pool.run(misuse_jobs.disagree_on_m_job, backend, BOUND_MS)
    check(res)
    for r in res:
        c = r["calls"][0]
        assert c["error"] in ("CollectiveMismatchError", "PeerAbortedError"), c
    mismatch = next(r["calls"][0]["message"] for r in res
                    if r["calls"][0]["error"] == "CollectiveMismatchError")
    assert "M=64" in mismatch and "M=48" in mismatch, mismatch


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_with_different_shared_settings_fail_to_build_on_every_rank(pool, backend):
    """E.g. RADIANCE_AR_SDMA_SCHEDULE oneshot on rank 0, twoshot on rank 1: such ranks
    would pair up calls that move different bytes, so building the backend fails on both,
    naming the variable and each rank's value."""
    res = pool.run(misuse_jobs.disagree_on_settings_job, backend, BOUND_MS)
    field = backends.get(backend).shared_settings[0]
    values = misuse_jobs.DISAGREEING_SETTINGS[field]
    for rank, r in enumerate(res):
        assert r["build"].get("error") == "ValueError", (rank, r["build"])
        message = r["build"]["message"]
        assert BackendSettings.KNOB_OF[field] in message, message
        assert f"rank 0: {values[0]!r}, rank 1: {values[1]!r}" in message, message
    world_jobs.assert_right_on_every_rank([r["after"] for r in res])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_paths_raise_on_both_ranks_within_the_bound_not_the_collective_timeout(
        pool, backend):
    res = pool.run(misuse_jobs.mixed_paths_job, backend, BOUND_MS)
    check(res)
    assert res[0]["calls"][0]["error"] == "CollectiveMismatchError"
    assert "vendor all-reduce" in res[0]["calls"][0]["message"]
    assert res[1]["calls"][0]["error"] == "PeerAbortedError"
    assert max(r["elapsed"] for r in res) < 5.0  # the pool's gloo timeout is 60 s


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("same_shape", [True, False], ids=["same-shape-late", "other-K-at-once"])
def test_a_skipped_call_raises_on_every_rank(pool, backend, same_shape):
    res = pool.run(misuse_jobs.skipped_call_job, backend, BOUND_MS, same_shape)
    check(res)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_thread_is_refused_and_every_rank_raises_until_resync(pool, backend):
    """A call from another thread than the first call's is refused, and the refusal
    faults the rank: its next call is refused, and the peer, which made the call the
    refused thread's rank never made, raises instead of pairing with a later call."""
    start = time.monotonic()
    res = pool.run(misuse_jobs.two_threads_job, backend, 2000.0)
    second = res[0]["second_thread"]
    assert second.get("error") == "RuntimeError", second
    assert "come from thread 'MainThread'" in second["message"], second
    assert res[0]["calls"][0]["error"] == "ResyncRequiredError", res[0]["calls"][0]
    check(res)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_refused_for_its_arguments_raises_on_every_rank(pool, backend):
    """A call the backend refuses before numbering it is a skipped call: the rank faults,
    so the peer that made it raises (not pairing it with the next), and the refusing rank's
    next call is refused until resync."""
    res = pool.run(misuse_jobs.refused_arguments_job, backend, BOUND_MS)
    assert res[0]["calls"][0]["error"] in ("TypeError", "ValueError"), res[0]["calls"][0]
    assert res[1]["calls"][0].get("error") in COLLECTIVE_ERRORS, res[1]["calls"][0]
    assert res[0]["calls"][1]["error"] == "ResyncRequiredError", res[0]["calls"][1]
    world_jobs.assert_right_on_every_rank([r["after_resync"] for r in res])


def test_one_shot_sdma_into_its_own_peer_visible_input_is_refused(pool):
    res = pool.run(misuse_jobs.in_place_job, "sdma")
    for r in res:
        assert r["calls"][0]["error"] == "ValueError", r["calls"][0]
        assert "out lies in the peer-visible input buffer" in r["calls"][0]["message"]
    world_jobs.assert_right_on_every_rank([r["after_resync"] for r in res])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_growth_leaves_no_buffers_a_clear_error_and_can_grow_again(pool, backend):
    res = pool.run(misuse_jobs.failed_growth_job, backend)
    for rank, r in enumerate(res):
        assert r["growth"].startswith("no space"), (rank, r["growth"])
        assert r["capacity"] == 0, (rank, r["capacity"])
        assert "call ensure_capacity first" in r["call"], (rank, r["call"])
        assert r["before_resync"]["error"] == "ResyncRequiredError", (rank, r["before_resync"])
        after = r["after"]
        assert "error" not in after and after["rel"] <= after["bound"], (rank, after)
