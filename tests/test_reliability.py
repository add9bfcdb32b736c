"""Faults and steady state in real CPU worlds: dead ranks, missing peers, soak, decode path."""

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import backends
import overlap
import world_jobs
from backends.cpu_world import CpuWorldPool, WorldError
from backends.world import single_world
from overlap.config import OverlapSettings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import soak  # noqa: E402


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


@pytest.mark.parametrize("backend", backends.names())
def test_soak_2000_calls_every_result_correct_and_memory_flat(cpu_world, backend):
    # N = 256: the codec backends need whole 256-value blocks
    r = cpu_world(2).run(soak.soak_job, backend, 2000, 600.0, 96, 256, 32, 32, 3, seed=5)[0]
    if "skipped" in r:
        pytest.skip(f"{backend}: {r['skipped']}")
    assert r["calls"] == 2000
    assert r["mismatches"] == []
    assert r["scratch_after_warmup"] == r["scratch_final"]


def test_decode_path_creates_no_stream_or_event(monkeypatch):
    world = single_world("cpu")
    backend = world_jobs.PeerSumBackend(world)
    rt = overlap.OverlapRuntime(world, OverlapSettings(True, backend.name, 64, 4), backend)
    for name in ("Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail(f"decode path made a {name}"))
    x, w = world_jobs.shard(0, 0, 16, 8, 32)
    for rows in (1, 7, 63):
        overlap.forward(rt, x[:rows].contiguous(), w, None, "bf16")
    assert rt._lanes is None and backend.buffer is None  # neither streams nor peer buffers
