"""Bad input to the op and to every backend in real CPU worlds: a clear error naming the
problem, nothing half-written, the ranks still in step so that the next call is right."""

import pytest
import torch

from radiance_ar import backends
from radiance_ar import overlap
import world_jobs
from radiance_ar.transport.world import World
from radiance_ar.overlap.config import OverlapSettings


def bad_then_good_job(world: World, backend: str) -> dict:
    """A bad call (N not a multiple of the codec block, or a shape mismatch), then good ones."""
    rt = overlap.build(world, OverlapSettings(True, backend, 1, 2))
    x, w = world_jobs.shard(1, world.rank, 32, 200, 64)  # N = 200: not a multiple of 256
    try:
        overlap.forward(rt, x, w, None, "bf16")
        error = None
    except (ValueError, TypeError) as e:
        error = f"{type(e).__name__}: {e}"
    x, w = world_jobs.shard(2, world.rank, 32, 256, 64)
    outs = [overlap.forward(rt, x, w, None, "bf16") for _ in range(3)]
    ref = world_jobs.reference(2, world.size, 32, 256, 64)
    rt.close()
    return {"error": error, "outs": outs, "ref": ref, "bound": rt.backend.rel_rms_bound}


def gate_job(world: World, backend: str) -> str:
    try:
        overlap.build(world, OverlapSettings(True, backend, 1, 2))
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("backend", ["sdma_wht6", "oneshot_wht6"])
def test_codec_backends_reject_n_off_the_block_then_keep_working(cpu_world, backend):
    if backend not in backends.names():
        pytest.skip(f"{backend} is not registered in this tree")
    results = cpu_world(2).run(bad_then_good_job, backend)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "256" in r["error"], (rank, r["error"])
        ref = r["ref"]
        for out in r["outs"]:
            assert world_jobs.rel_rms(out, ref) <= r["bound"], rank
            assert torch.equal(out, results[0]["outs"][0])


@pytest.mark.parametrize("backend", ["symm_oneshot", "symm_twoshot"])
def test_a_world_the_backend_cannot_serve_is_refused_with_the_reason(cpu_world, backend):
    messages = cpu_world(2).run(gate_job, backend)
    for m in messages:
        assert f"backend {backend!r} cannot run here" in m and "torchrun" in m


@pytest.mark.parametrize("backend", backends.names())
def test_every_backend_refuses_bad_slices_untouched_and_stays_in_step(cpu_world, backend):
    res = world_jobs.run_where_served(cpu_world(2), world_jobs.bad_slices_job, backend)
    for rank, r in enumerate(res):
        wrong = {label: e for label, e in r["errors"].items() if e is not True}
        assert not wrong, (rank, wrong)
    world_jobs.assert_right_on_every_rank(res)
