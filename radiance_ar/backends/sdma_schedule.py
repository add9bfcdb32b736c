"""The schedules of the copy-engine transport, and where it holds compute units.

``sdma`` (raw slices):

- one-shot: pull the W-1 peer slices into local receive buffers, reduce. Sends
  (W-1) x slice bytes per rank, one flag round trip.
- two-shot: rank r pulls shard r (1/W of the slice, flat elements) from every peer,
  reduces it into ``out`` and publishes it in ``red``; then pulls every peer's reduced
  shard into ``out``. Sends 2(W-1)/W x slice bytes per rank, two flag round trips.
- auto (:func:`auto_schedule`): one-shot when W <= 2 (both move the same bytes;
  one-shot has half the steps) or the slice is under 1 MiB (a DMA op has a fixed
  dispatch cost and reaches its full rate only from about 1 MiB per op:
  docs/history.md), else two-shot (half the bytes at W = 4). Measured against each
  other on one H200, 4 emulated ranks (``radiance_ar.diagnostics.host_cost``,
  tools/results/2026-12-03-h200-host-steps/): a 10 MiB call took 427 us of device time
  two-shot against 694 us one-shot, a 20 MiB one 726 against 1298 us; two-shot costs
  the host more (283-286 us against 186-217 us) but stays under its device time.

``sdma_wht6`` (wht6 payloads, sharded by payload ROWS: :func:`row_shards`):

- one-shot: pull the W-1 peer payloads, one decode-accumulate of all W. Pulls
  (W-1) x payload bytes per rank; the result is quantized once.
- two-shot: rank r pulls row shard r of every peer's payload, decode-accumulates it,
  re-encodes the reduced shard into ``red``; then pulls and decodes every peer's
  re-encoded shard. Pulls about 2(W-1)/W x payload bytes per rank, exactly
  :func:`wht6_twoshot_wire_bytes`; the result is quantized twice.
- auto (:func:`auto_schedule_wht6`): two-shot from ``WHT6_TWOSHOT_MIN_WORLD`` = 4 ranks
  on for a payload of at least ``AUTO_WHT6_TWOSHOT_MIN_BYTES`` per call, else one-shot.
  At W = 2 both pull one payload and two-shot only adds a quantization; W = 3 was not
  measured, so one-shot is kept there. The byte threshold comes from replayed op calls
  (one launch per call, :mod:`radiance_ar.overlap.graphs`) on one H200 with 4 emulated
  ranks, N = 5120, unsliced (tools/results/2026-12-04-h200-replayed-schedules/): two-shot
  won at every size measured, 0.253 against 0.351 ms at 1024 rows (3.9 MiB of payload),
  0.450 / 0.649 at 2048, 0.841 / 1.256 at 4096, 1.618 / 2.478 at 8192; under 1024 rows
  it was not measured, and one-shot (half the steps) is kept there. Enqueued step by
  step, a two-shot call cost the host about 1.1 ms whatever its size and lost up to 15.6
  MiB (tools/results/2026-12-03-h200-wht6-schedules/); a replayed call costs the host
  0.09-0.18 ms, so that crossover no longer applies.
"""

from __future__ import annotations

import math

AUTO_TWOSHOT_MIN_BYTES = 1 << 20
#: sdma_wht6 auto: two-shot only from this world size on (module doc)
WHT6_TWOSHOT_MIN_WORLD = 4
#: sdma_wht6 auto: two-shot from this many payload bytes per call: the smallest measured
#: win of replayed calls, 1024 x 5120 rows = 3.9 MiB, rounded down (W = 4; module doc)
AUTO_WHT6_TWOSHOT_MIN_BYTES = 3 << 20
# Two-shot shard bounds start on 16-byte boundaries: vectors for the reduce kernel, and
# the codec kernels see the pointer alignment of every other call (Triton specializes on
# it, and a first compile while a peer's stream waits can deadlock emulated ranks).
SHARD_ALIGN_BYTES = 16

#: how clr runs stream waits (its source, radiance_ar/transport/hip_ops.py; not measured)
HIP_WAITS = ("each flag wait (polling) and write is a one-work-item kernel of clr's on a compute "
             "unit (GPU_STREAMOPS_CP_WAIT=1 would need signal memory)")

# (world kind, platform) -> (holds compute units while waiting?, why). False only where
# the whole transport (waits and copies) is known to run without SMs/CUs.
COMPUTE_UNITS = {
    ("cpu-shm", "cpu"): (False, "CPU world: host copies and a host spin; there is no GPU"),
    ("single", "cpu"): (False, "one rank: a local copy"),
    ("single", "cuda"): (False, "one rank: a local copy"),
    ("single", "hip"): (False, "one rank: a local copy"),
    ("gpu-emulated", "cuda"): (False, (
        "waits: cuStreamWaitValue32 (GPU front end, no kernel); copies: D2H/H2D with pinned "
        "host memory on copy engines. radiance_ar.diagnostics.cu_free_check on one H200 (2026-12): the "
        "whole transport (publish, flags, 3 pulls, 160 MiB) completed with 132/132 SMs held; "
        "a GEMM 8192x4352x5120 ran 0.500 ms alone, 0.499 ms beside it")),
    ("gpu-emulated", "hip"): (True, (
        "not verified on ROCm: H2D/D2H should take SDMA (ROCm CLR code) unless "
        "HSA_ENABLE_SDMA=0; " + HIP_WAITS + "; run radiance_ar.diagnostics.cu_free_check on the "
        "machine")),
    ("gpu-host", "cuda"): (False, (
        "the operations of gpu-emulated (cuStreamWaitValue32; D2H/H2D copies with host memory "
        "pinned by cudaHostRegister, on copy engines), measured CU-free there; not measured "
        "in this world itself")),
    ("gpu-host", "hip"): (True, (
        "not verified on ROCm: H2D/D2H with hipHostRegister'd memory should take SDMA unless "
        "HSA_ENABLE_SDMA=0; " + HIP_WAITS + "; run radiance_ar.diagnostics.cu_free_check on the "
        "machine")),
    ("gpu-symm", "cuda"): (True, (
        "not verified: pulls are cudaMemcpyAsync on symmetric-memory mappings; a same-device "
        "D2D cudaMemcpyAsync did NOT progress with every SM held on an H200, and P2P copies "
        "were never checked here (one GPU); run radiance_ar.diagnostics.cu_free_check on a multi-GPU box")),
    ("gpu-symm", "hip"): (True, (
        "not verified: hipMemcpyAsync NoCU on mapped peer memory; ROCm 7.x bugs (NoCU ignored "
        "for P2P before rocm-systems#9100, #11318 unwritten destinations, #11510 gfx90a); "
        + HIP_WAITS)),
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


def auto_schedule_wht6(payload_bytes: int, world_size: int) -> str:
    """The schedule ``auto`` picks for sdma_wht6 and a payload of ``payload_bytes``
    (rule and measurement in the module doc)."""
    return ("twoshot" if world_size >= WHT6_TWOSHOT_MIN_WORLD
            and payload_bytes >= AUTO_WHT6_TWOSHOT_MIN_BYTES else "oneshot")


def row_shards(rows: int, world_size: int, row_bytes: int) -> list[int]:
    """Row bounds of the W two-shot shards of a payload of ``rows`` rows of ``row_bytes``
    bytes: balanced, each starting on a 16-byte boundary (whole units of 1 row, or 2
    where a row is 8 bytes off), so some shards are empty when rows < W."""
    if rows < 0 or world_size < 1 or row_bytes < 1:
        raise ValueError(f"row_shards: rows {rows}, world_size {world_size}, row_bytes "
                         f"{row_bytes}: expected rows >= 0 and the others >= 1")
    unit = SHARD_ALIGN_BYTES // math.gcd(row_bytes, SHARD_ALIGN_BYTES)
    units = -(-rows // unit)
    return [min(units * k // world_size * unit, rows) for k in range(world_size + 1)]


def wht6_twoshot_wire_bytes(rows: int, row_bytes: int, world_size: int, rank: int) -> int:
    """Bytes ``rank`` pulls in one two-shot sdma_wht6 call of ``rows`` payload rows:
    its own shard of each of the W-1 peers' payloads, then each peer's re-encoded
    shard. Summed over ranks exactly 2 (W-1) x rows x row_bytes."""
    if world_size < 2:
        return 0
    b = row_shards(rows, world_size, row_bytes)
    mine = b[rank + 1] - b[rank]
    return ((world_size - 1) * mine + rows - mine) * row_bytes
