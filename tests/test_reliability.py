"""Faults and steady state: dead ranks, missing peers and resync, soak (CPU worlds and
emulated ranks on one GPU), the decode path per backend."""

import os
import stat
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from radiance_ar import backends
import world_jobs
from radiance_ar.harness.cpu_world import CpuWorldPool, WorldError

import soak


def die_on_rank_1(world):
    if world.rank == 1:
        os._exit(3)
    t = torch.ones(4)
    dist.all_reduce(t)  # rank 0 waits for a peer that is gone
    return t


def stock_ar_unless_rank_1(world):
    backend = backends.get("stock")(world)
    t = torch.ones(8, 8, dtype=torch.bfloat16)
    if world.rank != 1:
        backend.all_reduce(t, t)
    return True


def sum_of_ranks(world):
    t = torch.full((4,), float(world.rank))
    dist.all_reduce(t)
    return t[0].item()


def test_a_dead_rank_is_a_clear_error_not_a_hang():
    with CpuWorldPool(2, collective_timeout_s=60) as pool:
        t0 = time.monotonic()
        with pytest.raises(WorldError, match=r"rank\(s\) \[1\] died"):
            pool.run(die_on_rank_1, timeout_s=120)
        assert time.monotonic() - t0 < 30  # noticed by liveness, not by a collective timeout
        assert pool.closed


def test_a_peer_that_never_arrives_times_out_and_a_fresh_world_works():
    with CpuWorldPool(2, collective_timeout_s=3) as pool:
        t0 = time.monotonic()
        with pytest.raises(WorldError, match="rank 0"):
            pool.run(stock_ar_unless_rank_1, timeout_s=60)
        assert time.monotonic() - t0 < 30
    with CpuWorldPool(2) as pool:
        assert pool.run(sum_of_ranks) == [1.0, 1.0]


def test_the_rendezvous_file_is_private_and_removed_on_every_path(tmp_path, monkeypatch):
    from radiance_ar.harness import cpu_world

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # see what a pool leaves behind
    with CpuWorldPool(2) as pool:
        assert pool.run(sum_of_ranks) == [1.0, 1.0]
        (folder,) = tmp_path.iterdir()
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert [(f.name, stat.S_IMODE(f.stat().st_mode)) for f in folder.iterdir()] == \
            [("store", 0o600)]
    assert list(tmp_path.iterdir()) == []
    with CpuWorldPool(2, collective_timeout_s=60) as pool:  # a rank dies: the pool closes
        with pytest.raises(WorldError, match="died"):
            pool.run(die_on_rank_1, timeout_s=120)
        assert list(tmp_path.iterdir()) == []

    class NoProcesses:
        def get_context(self, method):
            raise OSError("no processes here")

    monkeypatch.setattr(cpu_world, "mp", NoProcesses())
    with pytest.raises(OSError, match="no processes here"):
        CpuWorldPool(2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", backends.names())
def test_soak_2000_calls_every_result_correct_and_memory_flat(cpu_world, backend):
    # N = 256: the codec backends need whole 256-value blocks
    r = cpu_world(2).run(soak.soak_job, backend, 2000, 600.0, 96, 256, 32, 32, 3, seed=5)[0]
    if "skipped" in r:
        pytest.skip(f"{backend}: {r['skipped']}")
    assert r["calls"] == 2000
    assert r["mismatches"] == []
    assert r["memory_after_warmup"] == r["memory_final"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", world_jobs.waiting_backends())
def test_emulated_soak_on_one_gpu_correct_and_memory_flat(backend):
    # Every call sliced (M in 1..4096), 2 emulated ranks; cuda reserved/allocated included.
    r = soak.emulated_soak(backend, 2, torch.device("cuda", 0), 1000, 300.0, 4096, 512, 128,
                           4, seed=7)
    assert r["calls"] == 1000 and r["mismatches"] == []
    assert r["memory_after_warmup"] == r["memory_final"]


@pytest.mark.parametrize("backend", world_jobs.waiting_backends())
def test_a_missing_peer_raises_within_the_bound_then_resync_and_a_fresh_call_work(
        cpu_world, backend):
    res = cpu_world(2).run(world_jobs.missing_peer_then_resync_job, backend, 300.0)
    message, elapsed = res[0]["message"], res[0]["elapsed"]
    assert message is not None, "all_reduce returned although peer 1 never called"
    assert 0.25 < elapsed < 2.0, elapsed  # the 300 ms bound, not a hang
    assert "peer rank 1" in message and "epoch) 1" in message and backend in message, message
    world_jobs.assert_right_on_every_rank(res)


@pytest.mark.parametrize("backend", backends.names())
def test_decode_path_is_the_vendor_ar_with_no_stream_event_or_growth(cpu_world, backend):
    res = world_jobs.run_where_served(cpu_world(2), world_jobs.decode_path_job, backend)
    for rank, r in enumerate(res):
        assert r["made"] == [] and not r["grew"], (rank, r["made"], r["grew"])
        for rows, out in r["outs"].items():
            assert world_jobs.rel_rms(out, r["refs"][rows]) <= 2 ** -6, (rank, rows)
            assert torch.equal(out, res[0]["outs"][rows]), (rank, rows)
