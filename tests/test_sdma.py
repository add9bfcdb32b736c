"""The sdma backend in CPU worlds of real processes: exact sums, identical bits, bytes on
the wire, no stale flags over many calls, a bounded wait for a missing peer, the op."""

import math

import pytest
import torch

import sdma_jobs as jobs
import world_jobs  # noqa: E402
from radiance_ar.envs import BackendSettings
from radiance_ar.backends.sdma import SdmaBackend
from radiance_ar.backends.sdma_schedule import auto_schedule, shard_bounds
from radiance_ar.transport.world import single_world
from radiance_ar.overlap.slicing import slice_bounds

SHAPES = [(1, 8), (5, 24), (16, 40), (7, 3), (33, 64)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_exact_identical_and_wire_bytes(cpu_world, size):
    pool = cpu_world(size)
    for schedule in ("oneshot", "twoshot"):
        for slices, staged in ((1, False), (3, False), (2, True)):
            per_rank = pool.run(jobs.exact_job, schedule, SHAPES, slices, 11, staged)
            for call, (rows, cols) in enumerate(SHAPES):
                ref = jobs.bits(jobs.reference(11, call, size, rows, cols))
                outs = [per_rank[r][call][0] for r in range(size)]
                for r, out in enumerate(outs):
                    assert not torch.isnan(out).any(), (schedule, size, rows, cols, r)
                    assert torch.equal(jobs.bits(out), ref), (schedule, size, rows, cols, r)
                bounds = slice_bounds(rows, slices)
                nbytes = [(b - a) * cols * 2 for a, b in zip(bounds[:-1], bounds[1:])]
                pulled = [per_rank[r][call][1] for r in range(size)]
                # Summed over ranks the pulls are exact whatever the shard rounding ...
                per_call = (size - 1) * size if schedule == "oneshot" else 2 * (size - 1)
                assert sum(pulled) == per_call * sum(nbytes)
                # ... and with one-shot every rank pulls exactly wire_bytes.
                if schedule == "oneshot":
                    assert pulled == [sum(_wire(schedule, nb // 2, size) for nb in nbytes)] * size


def _wire(schedule, numel, size):
    return SdmaBackend(single_world(), BackendSettings(sdma_schedule=schedule)).wire_bytes(
        numel, size)


def test_wire_bytes_exact_when_even(cpu_world):
    pool = cpu_world(4)
    shapes = [(8, 64), (16, 128)]  # every slice a multiple of 16 B x W
    for schedule in ("oneshot", "twoshot"):
        per_rank = pool.run(jobs.exact_job, schedule, shapes, 2, 5, False)
        for call, (rows, cols) in enumerate(shapes):
            want = sum(_wire(schedule, (b - a) * cols, 4)
                       for a, b in zip(slice_bounds(rows, 2)[:-1], slice_bounds(rows, 2)[1:]))
            assert [per_rank[r][call][1] for r in range(4)] == [want] * 4
    assert _wire("twoshot", 1024, 4) == 3 * 1024
    assert _wire("oneshot", 1024, 4) == 6 * 1024


@pytest.mark.parametrize("size,schedule", [(3, "oneshot"), (4, "twoshot"), (2, "auto")])
def test_many_calls_no_stale_flags(cpu_world, size, schedule):
    results = cpu_world(size).run(jobs.long_job, schedule, 200 if size < 4 else 120, 3)
    for r, res in enumerate(results):
        assert res["bad"] == [], f"rank {r} wrong at calls {res['bad']}"
    assert all(res["hashes"] == results[0]["hashes"] for res in results)


def test_auto_picks_twoshot_for_large_slices_with_three_ranks(cpu_world):
    rows, cols = 256, 2048  # 1 MiB of bf16: at the auto threshold
    per_rank = cpu_world(3).run(jobs.exact_job, "auto", [(rows, cols), (4, 8)], 1, 2, False)
    assert per_rank[0][0][2] == ["twoshot"] and per_rank[0][1][2] == ["oneshot"]
    for call, (r_, c_) in enumerate([(rows, cols), (4, 8)]):
        ref = jobs.bits(jobs.reference(2, call, 3, r_, c_))
        assert all(torch.equal(jobs.bits(res[call][0]), ref) for res in per_rank)


@pytest.mark.parametrize("size,schedule", [(2, "oneshot"), (3, "twoshot"), (4, "oneshot")])
def test_through_the_overlap_op(cpu_world, size, schedule):
    rows, cols, k, seed = 29, 40, 48, 4
    slice_counts = [1, 2, 3, 4, 7]
    per_rank = cpu_world(size).run(jobs.op_job, schedule, rows, cols, k, slice_counts, seed)
    ref = world_jobs.reference(seed, size, rows, cols, k)
    for r, outs in enumerate(per_rank):
        assert len(outs) == 2 * len(slice_counts)
        for i, out in enumerate(outs):
            err = (out.double() - ref).norm() / ref.norm()
            assert err < 2 ** -7, (r, slice_counts[i // 2], float(err))
            # Every rank, every slicing: the same bits (fixed order, one rounding).
            assert torch.equal(jobs.bits(out), jobs.bits(per_rank[0][0])), (r, i)


def test_auto_rule_and_shards():
    assert auto_schedule(1 << 30, 2) == "oneshot"
    assert auto_schedule((1 << 20) - 2, 4) == "oneshot"
    assert auto_schedule(1 << 20, 3) == "twoshot"
    for numel in (0, 1, 7, 8, 100, 4096, 12345):
        for w in (2, 3, 4, 8):
            b = shard_bounds(numel, w, 2)
            assert b[0] == 0 and b[-1] == numel and b == sorted(b)
            assert all(x % 8 == 0 for x in b[:-1])
            sizes = [y - x for x, y in zip(b[:-1], b[1:])]
            assert max(sizes) - min(sizes) <= 8 + (numel % 8), (numel, w, sizes)


def test_schedule_and_timeout_settings_are_checked():
    with pytest.raises(ValueError, match="sdma_schedule='ring'.*one of auto, oneshot, twoshot"):
        BackendSettings(sdma_schedule="ring")
    with pytest.raises(ValueError, match="sdma_schedule='ring'"):
        SdmaBackend(single_world(), schedule="ring")  # a fixed schedule is checked alike
    with pytest.raises(ValueError, match=r"spin_timeout_ms=0 .*in \[1, 600000\]"):
        BackendSettings(spin_timeout_ms=0)
    with pytest.raises(TypeError, match="settings must be a radiance_ar.envs.BackendSettings"):
        SdmaBackend(single_world(), "twoshot")
    with pytest.raises(TypeError, match="settings must be a radiance_ar.envs.BackendSettings"):
        SdmaBackend(single_world(), "twoshot", schedule="oneshot")  # the override checks it too
    be = SdmaBackend(single_world(), BackendSettings(sdma_schedule="twoshot",
                                                     spin_timeout_ms=300))
    assert be.schedule == "twoshot"
    assert SdmaBackend(single_world(), be.settings, schedule="oneshot").schedule == "oneshot"
    with pytest.raises(ValueError, match="RADIANCE_AR_SDMA_SCHEDULE='fast'"):
        from radiance_ar import envs as envs
        envs.get("RADIANCE_AR_SDMA_SCHEDULE", {"RADIANCE_AR_SDMA_SCHEDULE": "fast"})


def test_single_rank_is_a_copy_and_input_view_needs_capacity():
    be = SdmaBackend(single_world())
    with pytest.raises(ValueError, match="ensure_capacity"):
        be.acquire_input_view(4, 4, torch.bfloat16)
    be.ensure_capacity(4, 4, torch.bfloat16)
    y = be.acquire_input_view(4, 4, torch.bfloat16)
    y.copy_(torch.arange(16.0).view(4, 4))
    out = torch.full((4, 4), math.nan, dtype=torch.bfloat16)
    be.all_reduce(y, out)
    assert torch.equal(out, y) and be.wire_bytes(16, 1) == 0
