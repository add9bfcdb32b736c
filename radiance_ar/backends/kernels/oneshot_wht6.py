"""Launch front end of the fused one-shot all-reduce with the wht6 codec (the kernel,
its protocol and its math: ``radiance_ar.backends.kernels.oneshot_wht6_kernel``).

This module imports without Triton (``radiance_ar.backends.oneshot_wht6`` imports it at package
import, on CPU-only installs too); the kernel module is imported at the first launch.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from radiance_ar import envs
from radiance_ar.launch import fast_launch
from radiance_ar.wht6 import wht6_launch
from radiance_ar.wht6 import BLOCK, SUB, padded_cols, payload_bytes_per_row

__all__ = ["DTYPES", "ITERS_PER_MS", "MAX_RANKS", "PASSIVE_EPOCH", "launch", "modes",
           "padded_cols", "payload_bytes_per_row"]

MAX_RANKS = 8  # payload and flag pointer arguments
ITERS_PER_MS = 1000  # spin bound without a timer (see the kernel module doc)
#: flag value of a passive peer (timing mode): above any epoch a run reaches; its
#: signature is not checked (the kernel compares with this value, 2**62)
PASSIVE_EPOCH = 2 ** 62
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def modes(device: torch.device) -> tuple[int, bool]:
    """(SYNC, TIMER) for kernels on ``device`` (ordering per platform: the kernel
    module's doc)."""
    if envs.triton_interpreter() or device.type == "cpu":
        return 0, False
    if torch.version.hip is not None:
        return 2, False
    return 1, True


def launch(x: torch.Tensor, out: torch.Tensor, pubs: Sequence[Any], flags: Sequence[Any],
           own: Any, err: Any, rank: int, region_bytes: int, timeout_ms: float, ctas: int,
           sig: int = 1, warm_up: bool = False) -> None:
    """Enqueue one call on the current stream (the protocol: the kernel module's doc).

    ``pubs`` / ``flags``: every rank's payload buffer (uint8, two regions of
    ``region_bytes``) and flag words (int64, at least ``ctas``), in rank order, as
    tensors or :func:`radiance_ar.launch.pointers.kernel_pointer` s. ``own``: this rank's
    private payload copy (or
    None: its payload is read back from ``pubs[rank]``). ``err``: int64 [5] error words
    (the kernel module's doc).
    ``sig``: the call's signature hash (1 .. 2**31 - 1), equal on every rank of one call.
    ``warm_up``: compile and launch with no work (no epoch, no flag), so that a later
    call does not compile while peers spin.
    """
    for label, t in (("x", x), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in DTYPES:
            raise TypeError(f"oneshot_wht6: {label} must be a 2-D tensor of {DTYPES}")
        if t.numel() and t.stride(1) != 1:
            raise ValueError(f"oneshot_wht6: {label} needs unit column stride")
    if x.shape != out.shape or x.dtype != out.dtype:
        raise ValueError(f"oneshot_wht6: out {tuple(out.shape)} {out.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    size = len(pubs)
    if not 1 <= size <= MAX_RANKS or len(flags) != size:
        raise ValueError(f"oneshot_wht6: need 1..{MAX_RANKS} payload buffers and as many flag "
                         f"arrays, got {size} and {len(flags)}")
    # The kernel's pointer arithmetic follows each argument's dtype.
    for label, group, dtype in (("pubs", pubs, torch.uint8), ("flags", flags, torch.int64),
                                ("own", [own] if own is not None else [], torch.uint8),
                                ("err", [err], torch.int64)):
        if any(getattr(a, "dtype", None) != dtype for a in group):
            raise TypeError(f"oneshot_wht6: {label} must be {dtype} (tensors or kernel_pointer)")
    if not 0 <= rank < size:
        raise ValueError(f"oneshot_wht6: rank {rank} outside 0..{size - 1}")
    if not isinstance(ctas, int) or ctas < 1:
        raise ValueError(f"oneshot_wht6: ctas must be an int >= 1, got {ctas!r}")
    if not isinstance(sig, int) or not 0 < sig < 2 ** 31:
        raise ValueError(f"oneshot_wht6: sig must be an int in 1..2**31-1, got {sig!r}")
    rows, cols = x.shape
    row_bytes = payload_bytes_per_row(cols) if cols else 0
    if rows * row_bytes > region_bytes or region_bytes % 8:
        raise ValueError(f"oneshot_wht6: payload of {rows}x{cols} needs {rows * row_bytes} B, "
                         f"region is {region_bytes} B (a multiple of 8 is required)")
    n_sub = 0 if warm_up else rows * padded_cols(cols) // SUB
    if n_sub >= 2 ** 31:
        raise ValueError(f"oneshot_wht6: {rows}x{cols} is over 2**36 values; split the call")
    if n_sub == 0 and not warm_up:
        return
    sync, timer = modes(x.device)
    bound = int(timeout_ms * 1e6) if timer else int(timeout_ms * ITERS_PER_MS)
    pad = MAX_RANKS - size
    t, warps = wht6_launch.ONESHOT
    try:
        from radiance_ar.backends.kernels.oneshot_wht6_kernel import oneshot_wht6_kernel
    except ImportError as e:
        raise RuntimeError(f"oneshot_wht6 on a GPU needs Triton: pip install triton ({e})") from None
    fast_launch.launch(
        oneshot_wht6_kernel, (ctas,),
        x, out, *pubs, *([pubs[0]] * pad), *flags, *([flags[0]] * pad),
        own if own is not None else pubs[rank], err, wht6_launch.levels(x.device), rank, n_sub,
        padded_cols(cols) // SUB, cols, max(x.stride(0), 1), max(out.stride(0), 1), row_bytes,
        region_bytes, max(bound, 1), sig, W=size, T=t, PADDED=cols % BLOCK != 0,
        NV_SQRT=sync == 1, OWN_COPY=own is not None, SYNC=sync, TIMER=timer, num_warps=warps,
        enable_fp_fusion=False)
