"""Launch shapes and the device-side level table of the wht6 kernels (host code; no
Triton here, so the sweep in tools/bench_codec.py can list the shapes anywhere).

A launch shape is (T, num_warps): T sub-blocks of 32 values per program and the
program's warps. T is a multiple of 32 * num_warps: every thread holds T / (32 *
num_warps) whole sub-blocks (``wht6_tile``), so T = 32 * num_warps gives one sub-block
(32 values, ~50-64 registers in an offline sm_90 compile) per thread and 64 * num_warps
two (more work in flight per thread, about twice the registers).

The shape comes from the tables below by kernel and shape class, never from timing at
run time. The class is what fixes a compiled variant anyway (the input dtype for
encode, the number of payloads for decode-accumulate), never the row count: the
backends compile their kernels before any peer waits by running them on 1 and 2 rows
of the real columns (``sdma_wht6._warm_codec``), and a shape keyed by rows would leave
a variant to compile at a first large call, while a peer's stream may be blocked.

bf16/fp16 encode and every decode class use the shapes an H200 sweep picked (``python
tools/bench_codec.py --device cuda --sweep`` times every shape of ``CANDIDATES`` per kernel
and class; the notes at :data:`ENCODE` and :data:`DECODE`); fp32 encode, not swept, keeps the
offline choice (one sub-block per thread, 4 warps: the fewest registers, so the most warps
per SM to hide memory latency).
"""
from __future__ import annotations

import torch

from radiance_ar import envs
from radiance_ar.wht6 import reference
from radiance_ar.streams import capturing

#: (T, num_warps) candidates the sweep times; T / (32 num_warps) sub-blocks per thread.
CANDIDATES = ((64, 2), (128, 4), (256, 8), (32, 1), (256, 4), (512, 8))

#: encode: by bytes per input value (2: bf16/fp16, 4: fp32). bf16: (32, 1), the fastest
#: of CANDIDATES in ``tools/bench_codec.py --device cuda --sweep`` on one H200,
#: 2026-12-03 (8192x5120: 0.60 of a D2D copy against 0.59 for (128, 4); the run is in
#: tools/results/2026-12-03-h200-codec/). fp32 input was not swept.
ENCODE = {2: (32, 1), 4: (128, 4)}
#: decode-accumulate: by the largest payload count of a class (1, 2, 4, 8); (32, 1) was
#: the fastest for W = 2, 4 and 8 in the same sweep (0.66 / 0.59 / 0.54 of a D2D copy
#: against 0.57 / 0.53 / 0.49 for (128, 4)), and with the register-gathered levels the
#: decode uses (0.73 / 0.66 / 0.62 against at most 0.50 / 0.47 / 0.47 for (64, 1), (64, 2) and
#: (128, 4): tools/results/2026-12-03-h200-codec-variants/); W = 1 (decode) follows W = 2.
DECODE = {1: (32, 1), 2: (32, 1), 4: (32, 1), 8: (32, 1)}
#: the fused one-shot all-reduce: one tile of T sub-blocks at a time per CTA
ONESHOT = (128, 4)

_levels: dict = {}


def encode_shape(dtype: torch.dtype) -> tuple:
    """(T, num_warps) for encoding ``dtype`` values."""
    return ENCODE[dtype.itemsize]


def decode_shape(n_payloads: int) -> tuple:
    """(T, num_warps) for summing ``n_payloads`` payloads (1..8)."""
    return DECODE[min(w for w in DECODE if w >= n_payloads)]


def check_shape(shape) -> tuple:
    """A caller's (T, num_warps), validated."""
    if (not isinstance(shape, tuple) or len(shape) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape)):
        raise TypeError(f"launch shape must be a (T, num_warps) tuple of ints, got {shape!r}")
    t, warps = shape
    if warps not in (1, 2, 4, 8, 16) or t < 32 * warps or t & (t - 1):
        raise ValueError(f"launch shape (T, num_warps) needs num_warps in 1..16 (a power of two) "
                         f"and T a power of two >= 32 * num_warps, got {shape}")
    return shape


def levels(device: torch.device) -> torch.Tensor:
    """The 64 fp32 dequantization factors ``reference.signed_levels(HEADROOM)`` on
    ``device`` (their bits are the reference's), built once per device and kept."""
    table = _levels.get(device)
    if table is None:
        if capturing(device):
            raise RuntimeError("wht6: the first decode on a device must run outside CUDA graph "
                               "capture (it uploads the level table); decode once before capturing")
        table = _levels[device] = reference.signed_levels(reference.HEADROOM).to(device)
    return table


def nv_sqrt(device: torch.device) -> bool:
    """Whether kernels on ``device`` take NVIDIA's sqrt fast path (``wht6_tile``): on
    CUDA devices, not under the Triton interpreter and not on ROCm."""
    return device.type == "cuda" and torch.version.hip is None and not envs.triton_interpreter()
