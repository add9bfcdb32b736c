"""Spinner that holds compute units: every program spins on a host-pinned flag.

Used by :mod:`radiance_ar.diagnostics.cu_free_check` to occupy every SM while a transfer runs: if the
transfer still completes, it needed no SM. Each program first records the SM it runs on
(``%smid`` + 1, 0 meaning "not started yet") in a host-pinned array, written through
to host memory so the host sees residency while the kernel runs, then re-reads the
flag until the host sets it non-zero. The spin is bounded by ``max_iters`` reads of
host memory (each one a PCIe round trip of about a microsecond), so a host that dies
does not leave the GPU spinning forever.

This module imports Triton; its callers (tools/spin_probe.py, radiance_ar/diagnostics/cu_free_check.py)
import it where they launch, on GPU paths only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radiance_ar.launch.pointers import HostPointer


@triton.jit
def spin_hold_kernel(
    flag_ptr,       # int32 in pinned host memory: 0 = hold, anything else = release
    started_ptr,    # int32 [programs] in pinned host memory: SM id + 1 once running
    max_iters,      # bound on flag reads, so the spin always ends
    RECORD_SM: tl.constexpr,  # record %smid (NVIDIA PTX); else record 1
):
    pid = tl.program_id(0)
    if RECORD_SM:
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                         is_pure=False, pack=1)
        tl.store(started_ptr + pid, smid + 1, cache_modifier=".wt")
    else:
        tl.store(started_ptr + pid, 1, cache_modifier=".wt")
    i = 0
    v = tl.load(flag_ptr, volatile=True)
    while (v == 0) & (i < max_iters):
        v = tl.load(flag_ptr, volatile=True)
        i += 1


def launch(flag: torch.Tensor, started: torch.Tensor, max_iters: int, num_warps: int = 4) -> bool:
    """Launch ``started.numel()`` spinning programs on the current stream (see module doc).

    Returns whether the programs record their SM id (``%smid``, NVIDIA) or just 1.
    """
    for label, t in (("flag", flag), ("started", started)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.is_cuda or not t.is_pinned():
            raise ValueError(f"spin_hold: {label} must be a pinned host int32 tensor")
    if not isinstance(max_iters, int) or max_iters < 1:
        raise ValueError(f"spin_hold: max_iters must be an int >= 1, got {max_iters!r}")
    args = (HostPointer(flag), HostPointer(started), max_iters)
    if torch.version.hip is None:
        try:
            spin_hold_kernel[(started.numel(),)](*args, RECORD_SM=True, num_warps=num_warps)
            return True
        except Exception:  # noqa: BLE001 -- an older Triton without operand-less inline asm
            pass
    spin_hold_kernel[(started.numel(),)](*args, RECORD_SM=False, num_warps=num_warps)
    return False
