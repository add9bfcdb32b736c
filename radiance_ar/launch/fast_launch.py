"""``kernel[grid](*args, **options)`` without the JIT's per-call work, for hot launches.

A Triton launch binds the arguments, computes the specialization key, looks the
compiled kernel up, then asks every tensor argument for its pointer and the driver for
that pointer's attributes: 32-38 us of host time for the 4-input reduce and 40-66 us
for the wht6 codec kernels on an H200 host, as much as ten copy-engine enqueues
(``python -m radiance_ar.diagnostics.host_steps``, tools/results/2026-12-03-h200-host-steps/).
:func:`launch` keys each call on the same properties Triton specializes on, finds the
compiled kernel once per key through Triton's own ``warmup`` (which compiles or looks it
up without launching) and from then on calls its launcher directly, with each pointer
passed as an int.

The key is at least as fine as Triton's: per positional argument, for a constexpr
parameter its value; for a pointer (anything with ``data_ptr()`` and ``dtype``:
tensors, :class:`radiance_ar.launch.pointers.Address`) its dtype and whether it is
16-byte aligned, and on ROCm for a tensor also whether its storage spans at most 2 GiB
(Triton's AMD backend then compiles 32-bit buffer offsets: its ``"S"`` specialization,
on by default through ``AMDGCN_USE_BUFFER_OPS``); for an int whether it is 1, whether 16 divides it and its type (i32,
i64 or u64, by range); anything else by type and value; the keywords (constexprs and
launch options) by name, type and value; plus the device. Not the grid: the launch
passes it, so a kernel whose grid follows the row count keeps one entry per variant,
not one per shape. A call that differs in any keyed property gets its own entry, so it
never runs a variant compiled for other arguments. (Checked against Triton 3.6's binder
and specializer on the project's kernels: the key never merged two of Triton's.)

The first call of each key launches through Triton (``kernel[grid](...)``, which also
checks that every pointer is device-accessible) and keeps the compiled kernel it
returns; the later ones call that kernel's launcher as ``JITFunction.run`` does (launch
hooks included). What they skip is per-call work that cannot change the variant here:
argument binding, pre-run hooks (none are registered), the check that the kernel's
globals have not changed, and the driver's query of each pointer.

Under the Triton interpreter (``TRITON_INTERPRET=1``: CPU tensors, no compiled kernels)
:func:`launch` is exactly ``kernel[grid](*args, **options)``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from radiance_ar import envs
from radiance_ar.streams import stream_object

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: (kernel, argument classes, keywords, device) -> (the compiled kernel, the values of the
#: parameters after the positional arguments)
_compiled: dict[tuple, Any] = {}
#: ROCm's Triton specializes a tensor on whether its storage spans at most 2 GiB - 1 bytes
#: (HIPBackend.is_within_2gb); CUDA's does not, and the key skips the query there (host time)
_KEY_STORAGE_SPAN = torch.version.hip is not None
_MAX_INT32 = 2 ** 31 - 1


@functools.cache
def _constexpr_mask(kernel: Any) -> tuple[bool, ...]:
    """Which of ``kernel``'s parameters are ``tl.constexpr`` (specialized by value)."""
    return tuple(p.is_constexpr for p in kernel.params)


def _arg_class(a: Any, constexpr: bool = False) -> Any:
    """What Triton specializes an argument on (module doc), as a hashable value."""
    if type(a) is int and not constexpr:  # noqa: E721  (bools are keyed by type and value)
        return (a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31, a >= 2 ** 63)
    ptr = getattr(a, "data_ptr", None)
    if ptr is not None:
        if _KEY_STORAGE_SPAN and isinstance(a, torch.Tensor):
            return (a.dtype, ptr() % 16 == 0, a.untyped_storage().size() <= _MAX_INT32)
        return (a.dtype, ptr() % 16 == 0)
    return (type(a), a)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, stream: int | None = None,
           **options: Any) -> None:
    """``kernel[grid](*args, **options)`` on ``stream`` (a raw handle; default the current
    stream of the current device), through the compiled kernel after the first call of
    its key (module doc). ``options`` are constexprs and launch options (no tensors)."""
    if envs.triton_interpreter():
        kernel[grid](*args, **options)
        return
    device = torch.cuda.current_device()
    if stream is None:
        stream = (_RAW_STREAM(device) if _RAW_STREAM is not None
                  else torch.cuda.current_stream(device).cuda_stream)
    key = (kernel, tuple(map(_arg_class, args, _constexpr_mask(kernel))),
           tuple((k, type(v), v) for k, v in options.items()), device)
    entry = _compiled.get(key)
    if entry is None:
        with torch.cuda.stream(stream_object(stream, torch.device("cuda", device))):
            compiled = kernel[grid](*args, **options)
        # The launcher takes every parameter in order, constexprs included (as
        # JITFunction.run passes them): those after the positional arguments come from
        # the keywords or their defaults.
        tail = tuple(options[p.name] if p.name in options else p.default
                     for p in kernel.params[len(args):])
        _compiled[key] = (compiled, tail)
        return
    from triton import knobs  # loaded with the compiled kernel; not at import (CPU installs)

    compiled, tail = entry
    bound = [a if type(a) is int or not hasattr(a, "data_ptr") else a.data_ptr() for a in args]
    bound.extend(tail)
    g0, g1, g2 = (*grid, 1, 1)[:3]
    # What JITFunction.run does once it has the compiled kernel (Triton 3.x).
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata((g0, g1, g2), stream, *bound),
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)
