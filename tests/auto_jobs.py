"""RADIANCE_AR_BACKEND=auto jobs run on every rank of a CPU world (module-level for the
pool's pickling): the op under ``auto`` with a tuning file the test wrote, one call per
M, each checked against the float64 reference; or a first call with a table of the
rank's own, to see ranks that would choose differently raise."""

from __future__ import annotations

import torch
import torch.distributed as dist

from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import World
from radiance_ar.overlap.config import OverlapSettings
from world_jobs import reference, rel_rms, shard

N, K = 256, 64  # N: one wht6 block, so every backend serves it
MIN_M = 16


def _auto(tuning: str, accuracy: str = "exact") -> OverlapSettings:
    return OverlapSettings(True, "auto", MIN_M, "auto", BackendSettings(spin_timeout_ms=500.0),
                           tuning=tuning, accuracy=accuracy)


def calls_job(world: World, tuning: str, accuracy: str, ms: list[int]) -> dict:
    """One op call per M: the chosen runtime's backend, S and plan, and the result's
    error against the float64 sum with the chosen backend's bound."""
    rt = overlap.build(world, _auto(tuning, accuracy))
    out = []
    for i, rows in enumerate(ms):
        x, w = shard(i, world.rank, rows, N, K)
        torch.manual_seed(1234)
        res = overlap.forward(rt, x, w, None, "bf16")
        child = rt.for_call(rows, N, "bf16")
        ref = reference(i, world.size, rows, N, K)
        decode = child is rt  # below MIN_M: GEMM, then the vendor all-reduce (stock)
        out.append({"M": rows, "backend": child.backend.name, "slices": child.settings.slices,
                    "plan": child.settings.plan, "rel": rel_rms(res, ref), "decode": decode,
                    "bound": (rt.stock if decode else child.backend).rel_rms_bound,
                    "word": child.backend.tuning_word})
    dist.barrier(group=world.group)
    rt.close()
    return {"calls": out, "word": rt.auto.word, "usable": rt.auto.usable}


def disagree_job(world: World, tunings: list[str], accuracies: list[str]) -> dict:
    """Rank r loads ``tunings[r]`` with ``accuracies[r]``; its first op call's outcome."""
    rt = overlap.build(world, _auto(tunings[world.rank], accuracies[world.rank]))
    x, w = shard(7, world.rank, 64, N, K)
    try:
        overlap.forward(rt, x, w, None, "bf16")
        result = {"error": None}
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        result = {"error": type(e).__name__, "message": str(e)}
    dist.barrier(group=world.group)
    rt.close()
    return result


def group_agreement_job(world: World, words: list[int]) -> dict:
    """The agreement of worlds whose flags the host cannot read (torchrun GPUs), through
    the process group, with rank r's word ``words[r]``."""
    rt = overlap.build(world, _auto(""))
    rt.auto.word = words[world.rank]
    try:
        rt.auto.agree_through_group()
        result = {"error": None}
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        result = {"error": type(e).__name__, "message": str(e)}
    rt.close()
    return result


def mixed_paths_job(world: World, tuning: str) -> dict:
    """Under auto, rank 1's call is below MIN_M (the decode path: the vendor all-reduce,
    announced on the parent's flags) while rank 0 slices the same call (on a child's)."""
    import time

    rt = overlap.build(world, _auto(tuning))
    x, w = shard(3, world.rank, 64, N, K)
    overlap.forward(rt, x, w, None, "bf16")  # the child built and agreed on every rank
    dist.barrier(group=world.group)
    rows = 64 if world.rank == 0 else MIN_M // 2
    x, w = shard(4, world.rank, rows, N, K)
    start = time.monotonic()
    try:
        overlap.forward(rt, x, w, None, "bf16")
        result = {"error": None}
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        result = {"error": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - start
    dist.barrier(group=world.group)
    rt.close()
    return result


def build_with_schedule_job(world: World, tuning: str, schedules: list[str]) -> dict:
    """Build an auto runtime with RADIANCE_AR_SDMA_SCHEDULE ``schedules[rank]``: the
    error it raised (or none), and how long building took."""
    import time

    start = time.monotonic()
    settings = OverlapSettings(True, "auto", MIN_M, "auto", BackendSettings(
        spin_timeout_ms=500.0, sdma_schedule=schedules[world.rank]), tuning=tuning)
    try:
        overlap.build(world, settings).close()
        return {"seconds": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
