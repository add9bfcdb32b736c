"""Backends with real peer memory: one GPU per process, NCCL, a symmetric-memory world.

Launch on a machine with >= 2 GPUs (each rank takes the GPU of its ``LOCAL_RANK``)::

    torchrun --nproc-per-node 2 -m pytest -q -m multigpu tests/test_multigpu.py

Every rank runs the same tests in the same order, so every collective has its partners.
Each test makes all its collective calls (gathers included) before it asserts anything:
a failed assertion on one rank then leaves no peer blocked, and the next test's calls
still pair up. A backend whose gate refuses the world (``unsupported_reason``: the same
on every rank) is skipped with the gate's reason.

Without torchrun (``LOCAL_RANK`` unset) or with fewer than 2 GPUs visible (conftest.py),
every test is skipped with the reason.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from radiance_ar import backends
from radiance_ar import overlap
import world_jobs
from radiance_ar import envs
from radiance_ar.backends.interface import Backend
from radiance_ar.transport.world import World, from_process_group
from radiance_ar.overlap.config import OverlapSettings

LOCAL_RANK = envs.torchrun_local_rank()

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(LOCAL_RANK is None,
                       reason="not launched by torchrun (LOCAL_RANK unset); run: torchrun "
                              "--nproc-per-node 2 -m pytest -q -m multigpu tests/test_multigpu.py"),
]

#: our backends, and torch's symmetric-memory all-reduces measured against them
OURS = ("stock", "sdma", "sdma_wht6", "oneshot_wht6")
REFERENCES = ("symm_oneshot", "symm_twoshot")
COLS = 512  # a multiple of 256: whole blocks of the wht6 codec
AR_ROWS = (96, 1, 7)  # one all_reduce per entry, the largest first (one ensure_capacity)
OP_ROWS = (96, 37)  # 37 rows in 4 slices: slices of unequal size
K, SLICES = 256, 4
#: the op's output is each rank's GEMM result rounded to bf16 before the all-reduce: one
#: more rounding (2^-8 relative) than the backend's bound, which is against the rounded inputs
GEMM_ROUNDING = 2.0 ** -8


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """This rank's symmetric-memory world; the process group lives as long as the module."""
    device = torch.device("cuda", LOCAL_RANK)
    torch.cuda.set_device(device)  # Triton launches on the current device
    dist.init_process_group("nccl", device_id=device)
    try:
        yield from_process_group(device=device)
    finally:
        torch.cuda.synchronize(device)
        dist.destroy_process_group()


def gate(name: str, world: World) -> None:
    reason = backends.get(name).unsupported_reason(world)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")


def settle(world: World, be: Backend) -> None:
    """Collective: every call this rank enqueued has finished (bounded wait, raising on a
    missing peer), then so have every rank's: no rank frees peer-visible memory that a
    peer's pulls may still read."""
    be.check()
    torch.cuda.synchronize(world.device)
    world.memory.barrier()


def every_rank(world: World, t: torch.Tensor) -> list[torch.Tensor]:
    """Collective: every rank's ``t`` (same shape and dtype on each), in rank order, on the CPU."""
    parts = [torch.empty_like(t) for _ in range(world.size)]
    dist.all_gather(parts, t.contiguous(), group=world.group)
    return [p.cpu() for p in parts]


def assert_right_and_identical(name: str, per_rank: list[torch.Tensor], ref: torch.Tensor,
                               bound: float, rank: int) -> None:
    err = world_jobs.rel_rms(per_rank[rank], ref)
    assert err <= bound, f"{name}: relative RMS error {err:.3g} > {bound:.3g} on rank {rank}"
    for r, other in enumerate(per_rank):
        assert torch.equal(other, per_rank[0]), f"{name}: rank {r}'s bits differ from rank 0's"


@pytest.mark.parametrize("name", OURS + REFERENCES)
def test_all_reduce_is_the_float64_sum_with_identical_bits_on_every_rank(world, name):
    gate(name, world)
    be = backends.get(name)(world)
    try:
        be.ensure_capacity(max(AR_ROWS), COLS, torch.bfloat16)
        outs = []
        for seed, rows in enumerate(AR_ROWS):
            x = world_jobs.slice_input(seed, world.rank, rows, COLS).to(world.device)
            out = torch.full_like(x, float("nan"))
            be.all_reduce(x, out)
            outs.append(out)
        settle(world, be)
        gathered = [every_rank(world, out) for out in outs]
    finally:
        be.close()
    for seed, (rows, per_rank) in enumerate(zip(AR_ROWS, gathered)):
        ref = world_jobs.inputs_sum(seed, world.size, rows, COLS)
        assert_right_and_identical(f"{name}, {rows} rows", per_rank, ref, be.rel_rms_bound,
                                   world.rank)


@pytest.mark.parametrize("name", OURS + REFERENCES)
def test_op_through_the_sliced_path(world, name):
    # stock is not pipelined: its op is the GEMM then one unsliced all-reduce.
    gate(name, world)
    rt = overlap.build(world, OverlapSettings(True, name, 1, SLICES))
    try:
        outs = []
        for seed, rows in enumerate(OP_ROWS):
            x, w = world_jobs.shard(seed, world.rank, rows, COLS, K)
            outs.append(overlap.forward(rt, x.to(world.device), w.to(world.device), None, "bf16"))
        settle(world, rt.backend)
        sliced = rt._lanes is not None  # the lanes are made by the first sliced call only
        gathered = [every_rank(world, out) for out in outs]
    finally:
        rt.close()
    assert sliced == rt.backend.pipelined, f"{name}: sliced path taken: {sliced}"
    for seed, (rows, per_rank) in enumerate(zip(OP_ROWS, gathered)):
        ref = world_jobs.reference(seed, world.size, rows, COLS, K)
        assert_right_and_identical(f"{name} op, {rows} rows", per_rank, ref,
                                   rt.backend.rel_rms_bound + GEMM_ROUNDING, world.rank)
