"""Misuse scenarios run on every rank of a world of processes (module-level for the pool's
pickling): CPU worlds, and GPU ranks in processes (gpu-host: tests/test_host_world_gpu.py).

Each job drives the op (``overlap.forward``) the way a broken caller would and records,
per rank and per call, either the error it raised or how far its result is from the
float64 reference. The tests then assert that no call returned a wrong result and that
every affected rank raised; after ``resync()`` a good call must be right again. On a GPU
a call's error may surface at ``check()`` (the host-side bound), which every call here
makes before it counts as done.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.signals import _HEADER
from radiance_ar.transport.world import World
from radiance_ar.overlap.config import OverlapSettings
from world_jobs import reference, rel_rms, shard

N = 256  # one wht6 block: every backend serves it
MIN_M = 48
SLICES = 4


#: the bound of the first runtime a process builds: its first call loads the GEMM's and
#: the backend's kernels, which took a rank over 300 ms longer than its peers with 4
#: processes sharing one H200 (gpu-host, 2026-12-04), a false timeout of the warm-up itself
FIRST_CALL_BOUND_MS = 60_000.0


def _runtime(world: World, backend: str, timeout_ms: float) -> overlap.OverlapRuntime:
    """A runtime whose buffers are grown by one good call on every rank (growth is a
    collective of the world's memory: a late rank would be waited for there, unbounded
    by the spin bound, instead of in the flags). A runtime with a loose bound makes the
    process's first call before it."""
    first = overlap.build(world, OverlapSettings(True, backend, MIN_M, SLICES, BackendSettings(
        spin_timeout_ms=FIRST_CALL_BOUND_MS)))
    warm = _call(first, world, 64, 64, seed=0)
    assert "error" not in warm and warm["rel"] <= warm["bound"], warm
    first.close()
    dist.barrier(group=world.group)
    rt = overlap.build(world, OverlapSettings(True, backend, MIN_M, SLICES,
                                              BackendSettings(spin_timeout_ms=timeout_ms)))
    warm = _call(rt, world, 64, 64, seed=0)
    assert "error" not in warm and warm["rel"] <= warm["bound"], warm
    dist.barrier(group=world.group)
    return rt


def _call(rt: overlap.OverlapRuntime, world: World, rows: int, k: int, seed: int,
          peers_rows: int | None = None) -> dict:
    """One op call; {"error": type, "message": ...} or {"rel": error vs the reference}.
    ``peers_rows``: the rows every OTHER rank uses (None: the same), for the reference."""
    x, w = (t.to(world.device) for t in shard(seed, world.rank, rows, N, k))
    start = time.monotonic()
    try:
        out = overlap.forward(rt, x, w, None, "bf16")
        if world.device.type == "cuda":
            rt.backend.check()  # the bound: a GPU call's error surfaces here
            out = out.cpu()
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        return {"error": type(e).__name__, "message": str(e),
                "seconds": time.monotonic() - start}
    if peers_rows is not None and peers_rows != rows:
        # a result where the ranks disagree is wrong by definition
        return {"rel": float("inf"), "bound": rt.backend.rel_rms_bound}
    ref = reference(seed, world.size, rows, N, k)
    return {"rel": rel_rms(out, ref), "bound": rt.backend.rel_rms_bound, "out": out, "ref": ref}


def _resync_and_good_call(rt: overlap.OverlapRuntime, world: World, res: dict) -> dict:
    dist.barrier(group=world.group)
    rt.backend.resync()
    res["after_resync"] = _call(rt, world, 64, 32, seed=99)
    rt.close()
    return res


def late_peer_job(world: World, backend: str, timeout_ms: float) -> dict:
    """Rank 1 starts its call 1.5 bounds late; then both ranks call again."""
    rt = _runtime(world, backend, timeout_ms)
    if world.rank == 1:
        time.sleep(1.5 * timeout_ms / 1000.0)
    res = {"calls": [_call(rt, world, 64, 32, seed=1)]}
    dist.barrier(group=world.group)
    res["calls"].append(_call(rt, world, 64, 32, seed=2))
    return _resync_and_good_call(rt, world, res)


def disagree_on_m_job(world: World, backend: str, timeout_ms: float) -> dict:
    """Both ranks on the sliced path, rank 0 with M = 64 and rank 1 with M = 48."""
    rt = _runtime(world, backend, timeout_ms)
    mine, theirs = (64, 48) if world.rank == 0 else (48, 64)
    return _resync_and_good_call(rt, world, {"calls": [_call(rt, world, mine, 32, 3, theirs)]})


#: per shared backend setting (``Backend.shared_settings``), rank 0's and rank 1's values
DISAGREEING_SETTINGS = {"sdma_schedule": ("oneshot", "twoshot"), "oneshot_ctas": (32, 16)}


def disagree_on_settings_job(world: World, backend: str, timeout_ms: float) -> dict:
    """The ranks set one of the backend's shared settings differently: building the
    runtime must fail on both. A runtime built alike afterwards is right."""
    from radiance_ar import backends

    field = backends.get(backend).shared_settings[0]
    settings = BackendSettings(spin_timeout_ms=timeout_ms,
                               **{field: DISAGREEING_SETTINGS[field][world.rank]})
    try:
        overlap.build(world, OverlapSettings(True, backend, MIN_M, SLICES, settings)).close()
        res = {"build": {}}
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        res = {"build": {"error": type(e).__name__, "message": str(e)}}
    dist.barrier(group=world.group)
    alike = _runtime(world, backend, timeout_ms)
    res["after"] = _call(alike, world, 64, 32, seed=99)
    alike.close()
    return res


def mixed_paths_job(world: World, backend: str, timeout_ms: float) -> dict:
    """Rank 1 has M = 40 (< MIN_M: decode path, the vendor all-reduce); rank 0 slices 64."""
    rt = _runtime(world, backend, timeout_ms)
    mine, theirs = (64, 40) if world.rank == 0 else (40, 64)
    start = time.monotonic()
    res = {"calls": [_call(rt, world, mine, 32, 4, theirs)]}
    res["elapsed"] = time.monotonic() - start
    return _resync_and_good_call(rt, world, res)


def skipped_call_job(world: World, backend: str, timeout_ms: float, same_shape: bool) -> dict:
    """Rank 0 skips call 1 (it raised before the op). ``same_shape``: it waits out the
    peer's bound first; else its next call is at once, a linear of another K."""
    rt = _runtime(world, backend, timeout_ms)
    res = {"calls": []}
    if world.rank == 1:
        res["calls"].append(_call(rt, world, 64, 32, seed=5))
    elif same_shape:
        time.sleep(2 * timeout_ms / 1000.0)
    k_next = 32 if same_shape else 64
    res["calls"].append(_call(rt, world, 64, k_next, seed=6))
    return _resync_and_good_call(rt, world, res)


def two_threads_job(world: World, backend: str, timeout_ms: float) -> dict:
    """On rank 0 a second thread calls the op (the first call's thread, the main one, owns
    the runtime), then the main thread makes the call rank 1 makes; resync after."""
    rt = _runtime(world, backend, timeout_ms)
    res: dict = {"calls": []}
    if world.rank == 0:
        second: dict = {}
        t = threading.Thread(target=lambda: second.update(_call(rt, world, 64, 32, seed=8)))
        t.start()
        t.join()
        res["second_thread"] = second
    res["calls"].append(_call(rt, world, 64, 32, seed=7))
    return _resync_and_good_call(rt, world, res)


def _backend_call(be, x: torch.Tensor, out: torch.Tensor) -> dict:
    """One all_reduce on the backend itself: {} or the error's type and message."""
    try:
        be.all_reduce(x, out)
        be.check()
        return {}
    except Exception as e:  # noqa: BLE001 -- the test inspects what was raised
        return {"error": type(e).__name__, "message": str(e)}


def refused_arguments_job(world: World, backend: str, timeout_ms: float) -> dict:
    """Rank 0's call is refused for its arguments (an fp16 out for a bf16 slice) before it
    takes a number; rank 1 makes the call. Then both make one more, resync and a good one."""
    rt = _runtime(world, backend, timeout_ms)
    be = rt.backend
    x = torch.randn(8, N).to(torch.bfloat16).to(world.device)
    bad = torch.empty(8, N, dtype=torch.float16 if world.rank == 0 else torch.bfloat16,
                      device=world.device)
    res = {"calls": [_backend_call(be, x, bad)]}
    dist.barrier(group=world.group)
    res["calls"].append(_backend_call(be, x, torch.empty_like(x)))
    return _resync_and_good_call(rt, world, res)


def in_place_job(world: World, backend: str) -> dict:
    """Every rank sums one call into the input view it acquired (out = slice_in, the
    peer-visible buffer): refused for one-shot sdma where peers read that buffer, on every
    rank alike; then resync and a good call."""
    rt = _runtime(world, backend, 2000.0)
    be = rt.backend
    view = be.acquire_input_view(8, N, torch.bfloat16)
    view.copy_(torch.randn(8, N).to(torch.bfloat16))
    # every rank past its acquire's fence before any rank's refusal faults it (a peer still
    # fencing would read the abort word and raise there)
    dist.barrier(group=world.group)
    res = {"calls": [_backend_call(be, view, view)]}
    return _resync_and_good_call(rt, world, res)


def failed_growth_job(world: World, backend: str) -> dict:
    """Every rank's growth fails (its peer-memory allocation raises, as a killed peer or a
    full /dev/shm would make it): the backend must hold no buffers, refuse a call with a
    clear error (which faults it: refused until resync), and grow and work again after resync."""
    rt = _runtime(world, backend, 1000.0)
    be, memory = rt.backend, world.memory
    allocate = memory.allocate

    def failing(name, nbytes):
        raise OSError(f"no space for {name}")

    memory.allocate = failing
    try:
        be.ensure_capacity(4096, N, torch.bfloat16)
        res = {"growth": "no error"}
    except OSError as e:
        res = {"growth": str(e)}
    finally:
        memory.allocate = allocate
    res["capacity"] = be.capacity
    # every rank's growth is over before any rank's refused call faults it (a peer still
    # quiescing for its growth would read the abort word and raise there)
    dist.barrier(group=world.group)
    x = torch.randn(8, N).to(torch.bfloat16)
    try:
        be.all_reduce(x, x.clone())
        res["call"] = "no error"
    except ValueError as e:
        res["call"] = str(e)
    dist.barrier(group=world.group)
    # the refused call took no number on this rank: it faulted it, so a peer that made the
    # call hears of it, and every call is refused until resync
    res["before_resync"] = _call(rt, world, 64, 32, seed=11)
    dist.barrier(group=world.group)
    rt.backend.resync()
    res["after"] = _call(rt, world, 64, 32, seed=11)
    rt.close()
    return res


def killed_peer_job(world: World, backend: str, timeout_ms: float) -> dict:
    """After a good call, the last rank's process is killed outright (``os._exit``, no
    clean-up of any kind) and every other rank makes the next call: each must raise
    within the bound. Returns the job's memory directory (gpu-host, cpu-shm) so the test
    can check that nothing is left once the pool is closed."""
    rt = _runtime(world, backend, timeout_ms)
    dist.barrier(group=world.group)
    if world.rank == world.size - 1:
        os._exit(9)
    res = {"calls": [_call(rt, world, 64, 32, seed=12)],
           "dir": getattr(world.memory, "_dir", None)}
    return res


def unchecked_stall_job(world: World, backend: str, limit_s: float) -> dict:
    """What a serving engine does (GPU ranks in processes): after a good call, rank 0 makes
    a call its peers never make, checks nothing and blocks on the device, as a sampler's
    copy of its tokens would. Its watchdog must stop it (SIGABRT) after ``limit_s`` s, its
    abort word set first; the other ranks watch for its process to exit and report."""
    rt = overlap.build(world, OverlapSettings(True, backend, MIN_M, SLICES, BackendSettings(
        spin_timeout_ms=FIRST_CALL_BOUND_MS, watchdog_s=limit_s), graphs="off"))
    warm = _call(rt, world, 64, 64, seed=0)
    assert "error" not in warm and warm["rel"] <= warm["bound"], warm
    dist.barrier(group=world.group)
    if world.rank == 0:
        x, w = (t.to(world.device) for t in shard(5, world.rank, 64, N, 64))
        overlap.forward(rt, x, w, None, "bf16")
        torch.cuda.synchronize()  # never returns: the watchdog stops this process
        return {"returned": True}
    return watch_rank_0_stop(world, rt, limit_s)


def watch_rank_0_stop(world: World, rt, limit_s: float) -> dict:
    """On a rank other than 0, while rank 0's watchdog should stop it within ``limit_s``:
    wait (bounded) for rank 0's process to exit; then how long that took, the dead peers,
    rank 0's abort word and its job directory (gone after its stop's clean-up)."""
    start = time.monotonic()
    while 0 not in world.memory.dead_peers() and time.monotonic() - start < limit_s + 60:
        time.sleep(0.05)
    return {"after_s": time.monotonic() - start, "dead": world.memory.dead_peers(),
            "abort": rt.backend.signals._read(0, _HEADER["abort"]),
            "dir": getattr(world.memory, "_dir", None)}
