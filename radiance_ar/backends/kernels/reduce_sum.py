"""Local reduce of the sdma backend: ``out = round(sum_{w=0..W-1} fp32(x_w))``.

The math and the work split are in the kernel module's doc
(``radiance_ar.backends.kernels.reduce_sum_kernel``); :func:`reference_reduce_sum` here does the same
adds in the same order with torch ops (CPU worlds), so both give the same bits.

This module is the host side and imports on a CPU-only machine without Triton; the
kernel is ``radiance_ar.backends.kernels.reduce_sum_kernel``, imported at the first launch. Set
``TRITON_INTERPRET=1`` before that to run the kernel on CPU tensors (tests do, in a
subprocess).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from radiance_ar.launch.pointers import Address

MAX_INPUTS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 2048  # elements per step: 256 threads (8 warps) x 8 bf16 = one 16-byte vector each
NUM_WARPS = 8


def _kernels() -> tuple[Any, Any]:
    """(fast, generic): fast is specialized for 16-byte aligned pointers and n % 16 == 0
    (16-byte vector loads); generic is specialized on nothing. Each compiles to ONE
    variant per (dtypes, W, HAS_ALSO), so :func:`warm_up` can load every variant a run
    will use before any stream blocks (see :func:`warm_up`)."""
    try:
        from radiance_ar.backends.kernels import reduce_sum_kernel as k
    except ImportError as e:
        raise RuntimeError(f"reduce_sum on a GPU needs Triton: pip install triton ({e})") from None
    return k.reduce_sum_kernel, k.reduce_sum_kernel_generic


@functools.cache
def _sm_count(index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once per device)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_ctas(gpu: bool) -> int:
    """Two CTAs per SM of the current device (RADIANCE_AR_SDMA_REDUCE_CTAS=0), 4 under the
    CPU interpreter."""
    return 2 * _sm_count(torch.cuda.current_device()) if gpu else 4


def _check(inputs: Sequence[torch.Tensor], out: torch.Tensor, also: torch.Tensor | None) -> None:
    if not isinstance(inputs, (list, tuple)) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise ValueError(f"reduce_sum: inputs must be a list of 1..{MAX_INPUTS} tensors, got "
                         f"{type(inputs).__name__} of {len(inputs) if hasattr(inputs, '__len__') else '?'}")
    # The labels are built only for an error: this check runs at every sdma call.
    def label(i: int) -> str:
        return f"inputs[{i}]" if i < len(inputs) else ("out", "also")[i - len(inputs)]

    if not isinstance(out, torch.Tensor):
        raise TypeError(f"reduce_sum: out must be a torch.Tensor, got {type(out).__name__}")
    n = out.numel()
    for i, t in enumerate([*inputs, out] + ([also] if also is not None else [])):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"reduce_sum: {label(i)} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"reduce_sum: {label(i)} dtype {t.dtype}, expected one of {DTYPES}")
        if not t.is_contiguous():
            raise ValueError(f"reduce_sum: {label(i)} must be contiguous")
        if t.numel() != n:
            raise ValueError(f"reduce_sum: {label(i)} has {t.numel()} elements, out has {n}")
    # the kernel stores into also the sum already rounded to out's dtype
    if also is not None and also.dtype != out.dtype:
        raise TypeError(f"reduce_sum: also dtype {also.dtype} must match out's {out.dtype}")


def reference_reduce_sum(inputs: Sequence[torch.Tensor], out: torch.Tensor,
                         also: torch.Tensor | None = None) -> None:
    """The same sum with torch ops (fp32 adds in input order, rounded once); CPU worlds use it."""
    _check(inputs, out, also)
    acc = inputs[0].reshape(-1).to(torch.float32, copy=True)
    for x in inputs[1:]:
        acc += x.reshape(-1).to(torch.float32)
    out.view(-1).copy_(acc)
    if also is not None:
        also.view(-1).copy_(acc)


def reduce_sum(inputs: Sequence[torch.Tensor], out: torch.Tensor,
               also: torch.Tensor | None = None, ctas: int | None = None) -> None:
    """Launch the kernel on the current stream: ``out (and also) = sum of inputs`` (module doc).

    ``ctas``: persistent programs; default 2 per SM on a GPU, 4 under the interpreter.
    """
    _check(inputs, out, also)
    if ctas is not None and (not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 1):
        raise ValueError(f"reduce_sum: ctas must be an int >= 1, got {ctas!r}")
    if out.numel():
        _launch(list(inputs), out, also, out.numel(), None, ctas or _default_ctas(out.is_cuda))


def launch_reduce(inputs: Sequence[int], out: int, also: int | None, n: int,
                  dtype: torch.dtype, stream: int, ctas: int | None = None) -> None:
    """The kernel by address on ``stream`` (a raw handle) of the current CUDA device:
    ``out`` (and ``also``) = the sum of the ``n``-element ``dtype`` arrays at ``inputs``.
    The transport's own call path: its buffers are checked when they are sized, so
    there are no per-call tensor checks here (:func:`reduce_sum` is the checked entry)."""
    assert 1 <= len(inputs) <= MAX_INPUTS and n > 0, (len(inputs), n)
    _launch([Address(a, dtype) for a in inputs], Address(out, dtype),
            None if also is None else Address(also, dtype), n, stream,
            ctas or _default_ctas(True))


def _launch(inputs: list, out: Any, also: Any, n: int, stream: int | None, ctas: int) -> None:
    """Pick the variant (the fast one where every pointer is 16-byte aligned and n % 16
    == 0) and the grid, then launch (:mod:`radiance_ar.launch.fast_launch`)."""
    from radiance_ar.launch.fast_launch import launch

    ptrs = [*inputs, out] if also is None else [*inputs, out, also]
    aligned = n % 16 == 0 and not any(p.data_ptr() % 16 for p in ptrs)
    launch(_kernels()[0 if aligned else 1], (min(ctas, -(-n // BLOCK)),),
           *inputs, *[inputs[0]] * (MAX_INPUTS - len(inputs)), out,
           out if also is None else also, n, stream=stream, W=len(inputs),
           HAS_ALSO=also is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


def warm_up(world_size: int, dtype: torch.dtype, device: torch.device,
            with_also: bool = False) -> None:
    """Compile and load both variants for ``world_size`` inputs of ``dtype`` now.

    Why: loading a GPU module can synchronize the device, and in a world of emulated
    ranks (one process) a rank's stream may be blocked on a flag that only a later
    host call of another rank posts: a first launch at that point would deadlock.
    """
    scratch = torch.zeros(64, dtype=dtype, device=device)
    xs = [scratch[:16]] * world_size
    also = scratch[32:48] if with_also else None
    fast, generic = _kernels()
    for kernel, n in ((fast, 16), (generic, 15)):
        kernel[(1,)](*(xs + [xs[0]] * (MAX_INPUTS - world_size)), scratch[16:32],
                     also if also is not None else scratch[16:32], n, W=world_size,
                     HAS_ALSO=with_also, BLOCK=BLOCK, num_warps=NUM_WARPS)
