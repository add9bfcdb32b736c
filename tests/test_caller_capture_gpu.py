"""The sliced path of sdma and sdma_wht6 inside a CALLER's CUDA graph, in the gpu-host
world (W processes on one GPU or more, the watchdog on): captured as vLLM captures,
replayed 100 times with new inputs, every result against float64 with the same bits on
every rank; the graph's own counts; growth refused afterwards; and a replay a peer skips
stopping its process through the watchdog (radiance_ar.transport.caller_graphs)."""

import pytest

import host_world_jobs as jobs
from radiance_ar.harness.cpu_world import CpuWorldPool

pytestmark = pytest.mark.gpu
ROWS, N, K, SLICES = 256, 512, 128, 4
REPLAYS = 100


@pytest.mark.parametrize("size,backend", [(2, "sdma"), (2, "sdma_wht6"), (4, "sdma_wht6")])
def test_a_callers_graph_replays_every_result_right(size, backend):
    with CpuWorldPool(size, collective_timeout_s=60, device="cuda", peer_memory="host") as pool:
        res = pool.run(jobs.caller_capture_job, backend, REPLAYS, ROWS, N, K, SLICES, 60.0,
                       timeout_s=600)
    if "skipped" in res[0]:
        pytest.fail(f"the gate refused the capture: {res[0]['skipped']}")
    for rank, r in enumerate(res):
        assert len(r["rels"]) == REPLAYS
        wrong = [(i, e) for i, e in enumerate(r["rels"]) if not e <= r["bound"]]  # NaN too
        assert not wrong, (rank, wrong)
        assert r["digests"] == res[0]["digests"], rank  # the same bits on every rank
        assert r["counts"] == (REPLAYS, REPLAYS, 1), r["counts"]  # entered, left, ident
        assert "growth requested after a caller's CUDA graph" in (r["grown"] or ""), r["grown"]
        assert r["own_graphs"] >= 1  # the eager warm-up went through the op's own graphs
    assert len(set(res[0]["digests"])) == REPLAYS  # every replay computed its own input


def test_a_replay_a_peer_skips_stops_the_process_through_the_watchdog():
    limit_s = 20.0
    with CpuWorldPool(2, collective_timeout_s=60, device="cuda", peer_memory="host") as pool:
        procs = list(pool._procs)
        res = pool.run(jobs.caller_graph_stall_job, "sdma", ROWS, N, K, limit_s, dying=(0,),
                       timeout_s=limit_s + 180)
    assert res[0] is None and procs[0].exitcode == -6, procs[0].exitcode  # SIGABRT
    seen = res[1]
    assert seen["dead"] == [0] and seen["abort"] > 0, seen  # the abort word came first
    # rank 1's clock starts at the barrier, rank 0's watchdog's up to a poll after its replay
    assert limit_s - 1 <= seen["after_s"] < limit_s + 15, seen
