"""``kernel[grid](*args, **options)`` without the JIT's per-call work, for hot launches.

A Triton launch binds the arguments, computes the specialization key, looks the
compiled kernel up, then asks every tensor argument for its pointer and the driver for
that pointer's attributes: 32-38 us of host time for the 4-input reduce and 40-66 us
for the wht6 codec kernels on an H200 host, as much as ten copy-engine enqueues
(``python -m diagnostics.host_steps``, tools/results/2026-12-03-h200-host-steps/).
:func:`launch` keys each call on the same properties Triton specializes on, finds the
compiled kernel once per key through Triton's own ``warmup`` (which compiles or looks it
up without launching) and from then on calls its launcher directly, with each pointer
passed as an int.

The key is at least as fine as Triton's: per argument, for a pointer (anything with
``data_ptr()`` and ``dtype``: tensors, :class:`backends.kernels.pointers.Address`) its
dtype and whether it is 16-byte aligned; for an int whether it is 1, whether 16 divides
it and its width (32 or 64 bit); anything else by value; plus the grid, the keywords
and the device. A call whose arguments differ in any of these gets its own entry, so
it never runs a variant compiled for other arguments.

Under the Triton interpreter (``TRITON_INTERPRET=1``: CPU tensors, no compiled kernels)
:func:`launch` is exactly ``kernel[grid](*args, **options)``.
"""

from __future__ import annotations

from typing import Any

import torch

from backends import envs

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: (kernel, grid, argument classes, options, device) -> (the compiled kernel's runner,
#: the constexpr values after the positional arguments)
_runners: dict[tuple, Any] = {}


def _arg_class(a: Any) -> Any:
    """What Triton specializes an argument on (module doc), as a hashable value."""
    if type(a) is int:  # noqa: E721  (bool is an int subclass and keyed by value below)
        return (a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31)
    ptr = getattr(a, "data_ptr", None)
    if ptr is not None:
        return (a.dtype, ptr() % 16 == 0)
    return (type(a), a)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, stream: int | None = None,
           **options: Any) -> None:
    """``kernel[grid](*args, **options)`` on ``stream`` (a raw handle; default the current
    stream of the current device), launched by address after the first call of its key."""
    if envs.triton_interpreter():
        kernel[grid](*args, **options)
        return
    device = torch.cuda.current_device()
    grid = (*grid, 1, 1)[:3]  # the compiled kernel's runner reads three grid dimensions
    key = (kernel, grid, tuple(map(_arg_class, args)), tuple(options.items()), device)
    entry = _runners.get(key)
    if entry is None:
        compiled = kernel.warmup(*args, grid=grid, **options)
        # The launcher takes every parameter in order, constexprs included (as
        # JITFunction.run passes them): the ones after the positional arguments come
        # from the keywords or their defaults.
        tail = tuple(options[p.name] if p.name in options else p.default
                     for p in kernel.params[len(args):])
        entry = _runners[key] = (compiled[grid], tail)  # loads the module if not loaded
    run, tail = entry
    if stream is None:
        stream = (_RAW_STREAM(device) if _RAW_STREAM is not None
                  else torch.cuda.current_stream(device).cuda_stream)
    run(*[a if type(a) is int or not hasattr(a, "data_ptr") else a.data_ptr() for a in args],
        *tail, stream=stream)
