"""The schedules of the sdma transport, and where its transport holds compute units.

- one-shot: pull the W-1 peer slices into local receive buffers, reduce. Sends
  (W-1) x slice bytes per rank, one flag round trip.
- two-shot: rank r pulls shard r (1/W of the slice, flat elements) from every peer,
  reduces it into ``out`` and publishes it in ``red``; then pulls every peer's reduced
  shard into ``out``. Sends 2(W-1)/W x slice bytes per rank, two flag round trips.
- auto: one-shot when W <= 2 (both move the same bytes; one-shot has half the steps)
  or the slice is under 1 MiB (a DMA op has a fixed dispatch cost and reaches its full
  rate only from about 1 MiB per op: docs/history.md), else two-shot (half the bytes at
  W = 4).
"""

from __future__ import annotations

AUTO_TWOSHOT_MIN_BYTES = 1 << 20
SHARD_ALIGN_BYTES = 16  # two-shot shard bounds: 16-byte vectors for the reduce kernel

# (world kind, platform) -> (holds compute units while waiting?, why). False only where
# the whole transport (waits and copies) is known to run without SMs/CUs.
COMPUTE_UNITS = {
    ("cpu-shm", "cpu"): (False, "CPU world: host copies and a host spin; there is no GPU"),
    ("single", "cpu"): (False, "one rank: a local copy"),
    ("single", "cuda"): (False, "one rank: a local copy"),
    ("single", "hip"): (False, "one rank: a local copy"),
    ("gpu-emulated", "cuda"): (False, (
        "waits: cuStreamWaitValue32 (GPU front end, no kernel); copies: D2H/H2D with pinned "
        "host memory on copy engines. diagnostics.cu_free_check on one H200 (2026-12): the "
        "whole transport (publish, flags, 3 pulls, 160 MiB) completed with 132/132 SMs held; "
        "a GEMM 8192x4352x5120 ran 0.500 ms alone, 0.499 ms beside it")),
    ("gpu-emulated", "hip"): (True, (
        "not verified on ROCm: H2D/D2H should take SDMA (ROCm CLR code) unless "
        "HSA_ENABLE_SDMA=0; run diagnostics.cu_free_check on the machine")),
    ("gpu-symm", "cuda"): (True, (
        "not verified: pulls are cudaMemcpyAsync on symmetric-memory mappings; a same-device "
        "D2D cudaMemcpyAsync did NOT progress with every SM held on an H200, and P2P copies "
        "were never checked here (one GPU); run diagnostics.cu_free_check on a multi-GPU box")),
    ("gpu-symm", "hip"): (True, (
        "not verified: hipMemcpyAsync NoCU on mapped peer memory; ROCm 7.x bugs (NoCU ignored "
        "for P2P before rocm-systems#9100, #11318 unwritten destinations, #11510 gfx90a)")),
}


def auto_schedule(nbytes: int, world_size: int) -> str:
    """The schedule ``auto`` picks for a slice of ``nbytes`` (rule in the module doc)."""
    return "twoshot" if world_size > 2 and nbytes >= AUTO_TWOSHOT_MIN_BYTES else "oneshot"


def shard_bounds(numel: int, world_size: int, elem_size: int) -> list[int]:
    """Element bounds of the W two-shot shards of a flat slice (16-byte aligned, balanced)."""
    unit = max(1, SHARD_ALIGN_BYTES // elem_size)
    units = -(-numel // unit)
    return [min(units * k // world_size * unit, numel) for k in range(world_size + 1)]


def schedule_wire_bytes(schedule: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank pulls for a slice of ``nbytes`` under ``schedule`` (auto resolved)."""
    if world_size < 2:
        return 0
    if schedule == "oneshot" or (schedule == "auto"
                                 and auto_schedule(nbytes, world_size) == "oneshot"):
        return (world_size - 1) * nbytes
    # pulled per rank: (W-1) shards of the reduce-scatter + (W-1) reduced shards;
    # summed over ranks exactly 2 (W-1) x nbytes whatever the shard rounding.
    return 2 * (world_size - 1) * nbytes // world_size
