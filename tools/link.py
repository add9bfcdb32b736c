"""The raw link under the all-reduce, measured in the same run (issue "sdma at the link's speed").

``link_gbs`` is the rate of the bare copies that would carry a case's wire bytes: no
flags, no reduce, no GEMM beside them. It is the ceiling of a transport riding that
link, so ``link_efficiency = bus_gbs / link_gbs`` says how much of the link the AR gets.

The copies imitate the transfer sizes of a sliced one-shot pull (sdma's): per slice,
one copy from each of the W-1 peers, each of ``wire_bytes / ((W-1) S)`` bytes, all
back to back on one stream. Other schedules move the same bytes in other pieces; for
them this is the same bytes in (W-1) S pieces, an approximation. The compare tool asks
for S = 1 whatever the case's slicing: ``bus_gbs`` is the unsliced AR's rate, so its
copies are the unsliced call's (until 2026-12-05 it asked for the case's S, so rows of
one M got different ``link_efficiency`` values from one AR time).

- gpu-emulated: the peers' buffers are pinned host memory, so each copy is an H2D copy
  over the host link into device memory (the active rank's pulls; its D2H publish is
  not part of it).
- gpu-symm (torchrun): every rank pulls from every peer's symmetric-memory buffer at
  the same time, as in the AR, after a barrier.

Copies go through :class:`radiance_ar.transport.copy_engine.CopyEngine` (the sdma transport's own
call) where its bindings are installed, else ``Tensor.copy_`` (NVIDIA: the same
``cudaMemcpyAsync``; ROCm: a same-device copy of peer memory then runs as a kernel).
Results are cached per (world, copy size, copy count): one measurement per (M, S) size,
shared by the backends whose wire bytes agree. CPU worlds: None (nothing to compare).
"""

from __future__ import annotations

from typing import Callable

import torch

import gpu_timing
import metrics
from radiance_ar.transport.copy_engine import CopyEngine, bindings_reason
from radiance_ar.transport.world import World

#: the median of fewer repeats moves with a single slow copy batch
LINK_MIN_REPS = 10

_CACHE: dict[tuple, float] = {}


def copy_plan(wire_bytes: int, world_size: int, slices: int) -> tuple[int, int]:
    """(bytes per copy, number of copies): (W-1) x S copies carrying ``wire_bytes``."""
    for label, v in (("wire_bytes", wire_bytes), ("world_size", world_size), ("slices", slices)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"copy_plan: {label} must be an int, got {type(v).__name__}")
    if world_size < 2 or slices < 1:
        raise ValueError(f"copy_plan: expected world_size >= 2 and slices >= 1, got "
                         f"world_size={world_size}, slices={slices}")
    copies = (world_size - 1) * slices
    if wire_bytes < copies:
        raise ValueError(f"copy_plan: {wire_bytes} wire bytes cannot fill {copies} copies "
                         "of at least one byte")
    return wire_bytes // copies, copies


def link_gbs(world: World, wire_bytes: int, slices: int, reps: int, warmup: int) -> float | None:
    """GB/s (1e9) of the raw link for ``wire_bytes`` in S slices (see module doc); None
    on a CPU world or without peers. Collective in a gpu-symm world: every rank calls it
    with the same arguments in the same order."""
    if world.device.type != "cuda" or world.size < 2 or wire_bytes < (world.size - 1) * slices:
        return None
    chunk, copies = copy_plan(wire_bytes, world.size, slices)
    key = (world.kind, world.size, world.device.index, chunk, copies)
    if key not in _CACHE:
        ms, _ = metrics.median_and_spread(_time_pulls(world, chunk, slices, reps, warmup))
        _CACHE[key] = metrics.bus_bandwidth_gbs(chunk * copies, ms)
    return _CACHE[key]


def _copier(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if bindings_reason(device) is None:
        engine = CopyEngine(device)
        return lambda dst, src: engine.copy(dst, src, torch.cuda.current_stream(device).cuda_stream)
    return lambda dst, src: dst.copy_(src, non_blocking=True)


def _time_pulls(world: World, chunk: int, slices: int, reps: int, warmup: int) -> list[float]:
    size, rank = world.size, world.rank
    # Collective allocation: each rank's buffer holds the S chunks its peers pull.
    buf = world.memory.allocate("link_probe", slices * chunk)
    dst = torch.empty((size - 1) * slices * chunk, dtype=torch.uint8, device=world.device)
    order = [(rank + k) % size for k in range(1, size)]  # as sdma: not all from rank 0 first
    copy = _copier(world.device)
    pieces = []
    for s in range(slices):
        for j, p in enumerate(order):
            at = (s * (size - 1) + j) * chunk
            pieces.append((dst[at:at + chunk], buf.peer(p)[s * chunk:(s + 1) * chunk]))

    def pull(i: int) -> None:
        for d, s in pieces:
            copy(d, s)

    samples = gpu_timing.event_times(pull, max(reps, LINK_MIN_REPS), warmup,
                                     before=world.memory.barrier)
    # No rank frees its buffer while a peer may still be pulling from it.
    torch.cuda.synchronize(world.device)
    world.memory.barrier()
    return samples
