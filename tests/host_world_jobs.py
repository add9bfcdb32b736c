"""Jobs for the gpu-host world, run on every rank (one process each, all on one GPU) of a
``CpuWorldPool(W, device="cuda:0", peer_memory="host")`` (module-level: pickled by name).

Inputs are ``world_jobs.shard`` (seeded by seed and rank), so the tests rebuild every
rank's inputs and the float64 reference on their own.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from radiance_ar import backends, overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.harness.host import resident_bytes
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.transport.copy_engine import CopyEngine
from radiance_ar.transport.world import World
from misuse_jobs import FIRST_CALL_BOUND_MS, watch_rank_0_stop
from sdma_jobs import digest
from world_jobs import reference, rel_rms, shard



def probe_job(world: World) -> dict:
    """What this rank's world is, and whether a buffer of it is registered host memory
    that this rank's GPU writes with a copy and its peers read."""
    buf = world.memory.allocate("probe", 4096)
    engine = CopyEngine(world.device)
    mine = torch.full((4096,), world.rank + 1, dtype=torch.uint8, device=world.device)
    engine.copy(buf.local, mine, torch.cuda.current_stream().cuda_stream)  # D2H, copy engine
    torch.cuda.synchronize()
    world.memory.barrier()
    seen = [int(buf.peer(p)[0]) for p in range(world.size)]
    whole = [bool((buf.peer(p) == p + 1).all()) for p in range(world.size)]
    return {"kind": world.kind, "label": world.label, "reason": world.memory_reason,
            "pinned": [buf.peer(p).is_pinned() for p in range(world.size)],
            "device_address_is_host": [engine.device_address(buf.peer(p)) == buf.peer(p).data_ptr()
                                       for p in range(world.size)],
            "seen": seen, "whole": whole, "served": {n: backends.get(n).unsupported_reason(world)
                                                      for n in backends.names()}}


def _settings(backend: str, min_m: int, slices: int | str, graphs: str,
              timeout_ms: float = 1000.0) -> OverlapSettings:
    return OverlapSettings(True, backend, min_m, slices,
                           BackendSettings(spin_timeout_ms=timeout_ms), graphs=graphs)


def layer_inputs(seed: int, rank: int, rows: int, cols: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rank``'s activation of ``seed`` and its weight of the layer of width ``k`` (one
    weight per K for every input draw: the op captures a layer's calls by its weight)."""
    return shard(seed, rank, rows, cols, k)[0], shard(1000 + k, rank, 1, cols, k)[1]


def layer_reference(seed: int, size: int, rows: int, cols: int, k: int) -> torch.Tensor:
    """float64 sum over ranks of :func:`layer_inputs`' products."""
    return reference(seed, size, rows, cols, k, inputs=layer_inputs)


def op_job(world: World, backend: str, graphs: str, calls: list, cols: int, min_m: int,
           slices: int) -> dict:
    """One runtime; for each (rows, k, seed) of ``calls`` one op call of the layer of
    width k (checked, then moved to the CPU). Also what the runtime did: graphs captured
    and replayed, the collective it calls."""
    rt = overlap.build(world, _settings(backend, min_m, slices, graphs))
    weights: dict[int, torch.Tensor] = {}
    outs = []
    for rows, k, seed in calls:
        x, w = layer_inputs(seed, world.rank, rows, cols, k)
        w = weights.setdefault(k, w.to(world.device))  # the layer's weight stays put
        out = overlap.forward(rt, x.to(world.device), w, None, "bf16")
        rt.backend.check()
        outs.append(out.cpu())
    graph_cache = rt._graphs
    res = {"outs": outs, "bound": rt.backend.rel_rms_bound,
           "captures": graph_cache.captures if graph_cache is not None else 0,
           "replays": graph_cache.replays if graph_cache is not None else 0,
           "collective": getattr(rt.backend, "collective", None),
           "compute_units": rt.backend.uses_compute_units_while_waiting}
    rt.close()
    return res


def soak_job(world: World, backend: str, calls: int, rows: int, cols: int, k: int,
             warm: int) -> dict:
    """``calls`` op calls of one layer (one weight, the default graph setting) after
    ``warm`` calls; the memory of the process, the GPU and the peer memory before and
    after, and the last output, whose activation is seed ``calls``'s (the others seed
    0's), so a replay that wrote nothing new would show."""
    # the backend's own slice count: oneshot_wht6 unsliced, whose spinning kernels of
    # processes sharing one GPU wait for each other's time slices
    rt = overlap.build(world, _settings(backend, min(rows, 64), "auto", "auto"))
    x0, w = (t.to(world.device) for t in layer_inputs(0, world.rank, rows, cols, k))
    xs = [(x0, w), (layer_inputs(calls, world.rank, rows, cols, k)[0].to(world.device), w)]

    def snapshot() -> dict:
        torch.cuda.synchronize()
        return {"gpu_allocated": torch.cuda.memory_allocated(),
                "gpu_reserved": torch.cuda.memory_reserved(),
                "resident": resident_bytes(),
                "peer_allocations": world.memory.allocations,
                "peer_bytes": world.memory.allocated_bytes}

    for i in range(warm):  # as below: the previous output lives until the next is made
        out = overlap.forward(rt, *xs[0], None, "bf16")
        if i == 0:
            # The first call compiles the backend's kernels in every process at once: on
            # one H200 a W = 4 rank's first sdma_wht6 call took 1.0-6.1 s and one rank's
            # ran over a 1000 ms bound past its peers' (their 19 replays queued behind it).
            rt.backend.check(FIRST_CALL_BOUND_MS)
    rt.backend.check()
    before = snapshot()
    for i in range(calls):
        out = overlap.forward(rt, *xs[1 if i == calls - 1 else 0], None, "bf16")
        if i % 50 == 49:
            rt.backend.check()  # bounded: a stuck peer shows within the bound, not at the end
    rt.backend.check()
    after = snapshot()
    graph_cache = rt._graphs
    res = {"before": before, "after": after, "out": out.cpu(), "bound": rt.backend.rel_rms_bound,
           "replays": graph_cache.replays if graph_cache is not None else 0}
    rt.close()
    return res


def _caller_graph(world: World, backend: str, rows: int, cols: int, k: int, slices: int,
                  watchdog_s: float) -> SimpleNamespace:
    """A runtime whose sliced call of ``rows`` rows the caller captured as vLLM does
    (``torch.cuda.graph``, after eager calls of the shape): ``rt``, ``graph``, its input
    ``x`` and output ``out``; or ``rt`` and the gate's ``reason`` where it is refused."""
    rt = overlap.build(world, OverlapSettings(True, backend, rows, slices, BackendSettings(
        spin_timeout_ms=FIRST_CALL_BOUND_MS, watchdog_s=watchdog_s), graphs="on"))
    made = SimpleNamespace(rt=rt, reason=rt.caller_capture_reason())
    if made.reason is not None:
        return made
    # the weight is held here: both graphs (the op's own, the caller's) read it by address
    made.x, made.w = (t.to(world.device) for t in layer_inputs(0, world.rank, rows, cols, k))
    for _ in range(3):  # sizes every buffer, loads every kernel; the op's own graph too
        overlap.forward(rt, made.x, made.w, None, "bf16")
        rt.backend.check(FIRST_CALL_BOUND_MS)
    made.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(made.graph):
        made.out = overlap.forward(rt, made.x, made.w, None, "bf16")
    return made


def caller_capture_job(world: World, backend: str, replays: int, rows: int, cols: int, k: int,
                       slices: int, watchdog_s: float) -> dict:
    """The caller's graph replayed ``replays`` times, the activation of seed i copied in
    before replay i and the output poisoned with NaN; each output checked here against
    float64 (its relative RMS error) and digested (the ranks compare bits). Then the
    counts the graph kept, and what an eager call that would grow the buffers raises."""
    made = _caller_graph(world, backend, rows, cols, k, slices, watchdog_s)
    rt = made.rt
    if made.reason is not None:
        rt.close()
        return {"skipped": made.reason}
    rels, digests = [], []
    for i in range(1, replays + 1):
        made.x.copy_(layer_inputs(i, world.rank, rows, cols, k)[0])
        made.out.fill_(float("nan"))
        made.graph.replay()
        got = made.out.cpu()  # a stuck replay blocks here: the watchdog's to end
        rels.append(rel_rms(got, layer_reference(i, world.size, rows, cols, k)))
        digests.append(digest(got))
    counts = rt.backend.caller_progress.snapshot()
    x, w = (t.to(world.device) for t in layer_inputs(1, world.rank, 2 * rows, cols, k))
    try:
        overlap.forward(rt, x, w, None, "bf16")
        grown = None
    except RuntimeError as e:
        grown = str(e)
    res = {"rels": rels, "digests": digests, "bound": rt.backend.rel_rms_bound,
           "counts": counts, "grown": grown, "own_graphs": rt._graphs.captures}
    del made.graph
    rt.close()
    return res


def caller_graph_stall_job(world: World, backend: str, rows: int, cols: int, k: int,
                           limit_s: float) -> dict:
    """Rank 0 replays the caller's graph a second time, which its peers skip, and blocks
    on the device behind it; its watchdog must stop it (SIGABRT) after ``limit_s`` s, its
    abort word set first. The other ranks watch for its process to exit and report."""
    made = _caller_graph(world, backend, rows, cols, k, 2, limit_s)
    assert made.reason is None, made.reason
    made.graph.replay()
    torch.cuda.synchronize()  # every rank's first replay completes
    dist.barrier(group=world.group)
    if world.rank == 0:
        made.graph.replay()
        torch.cuda.synchronize()  # never returns: the watchdog stops this process
        return {"returned": True}
    return watch_rank_0_stop(world, made.rt, limit_s)
