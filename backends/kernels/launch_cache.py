"""Launch a Triton kernel through its compiled binary once its variant is known.

Why: a launch through ``@triton.jit``'s ``kernel[grid](...)`` binds and specializes
every argument in Python before it reaches the driver. On one H200 that made a launch
of the codec or the reduce cost the host 32-66 us (``python -m diagnostics.host_steps``:
``wht6.encode`` 40 us, ``wht6.decode_accumulate`` of 4 payloads 66 us, ``reduce_sum``
32 us; a driver call such as a copy or a flag is 2-6 us), and every slice of an
all-reduce pays one to four of them on the host thread that also enqueues the copies.

How: :class:`CachedLaunch` launches through the JIT the first time it sees a variant,
keeps the compiled kernel the JIT returns, and launches that kernel directly after.
A variant is what Triton compiles one binary for: the constexpr values, the launch
options, and per argument what Triton specializes on. :func:`variant_key` keeps a
superset of that (pointer dtype and 16-byte alignment; for an int, whether it is 1,
whether it divides by 16, whether it fits 32 bits), so two calls with one key run one
binary. The direct launch is ``CompiledKernel[grid](*args, stream=...)``, Triton's own
entry point for a compiled kernel; where a Triton build lacks it (or runs the
interpreter, which compiles nothing), every launch goes through the JIT: the same
results, only slower.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_I32 = (-2**31, 2**31)


def _arg_key(arg: Any) -> tuple:
    if isinstance(arg, torch.Tensor):
        return ("t", arg.dtype, arg.data_ptr() % 16 == 0, arg.device.index)
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, _I32[0] <= arg < _I32[1])
    if isinstance(arg, float):
        return ("f",)
    if arg is None:
        return ("n",)
    raise TypeError(f"launch_cache: no variant key for an argument of type {type(arg).__name__}")


def variant_key(args: tuple, constexprs: dict, options: dict) -> tuple:
    """What decides the compiled variant of a launch (module doc), as a hashable key."""
    return (tuple(_arg_key(a) for a in args), tuple(sorted(constexprs.items())),
            tuple(sorted(options.items())))


class CachedLaunch:
    """``kernel[grid](*args, **constexprs, **options)``, direct once the variant is known.

    ``args``: the kernel's run-time arguments in signature order (tensors, ints, floats),
    which come first in its signature; ``constexprs``: the rest, by name; ``options``:
    launch options (``num_warps``, ``enable_fp_fusion``...). Like the JIT, a launch runs
    on the current stream of the current device.
    """

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, options: dict) -> None:
        key = variant_key(args, constexprs, options)
        hit = self._compiled.get(key)
        if hit is not None:
            compiled, tail = hit
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)  # takes 3 dimensions
            return
        compiled = self.kernel[grid](*args, **constexprs, **options)
        names = getattr(self.kernel, "arg_names", None)
        if names is not None:
            assert list(names[len(args):]) == list(constexprs), (names, len(args), constexprs)
        if (names is not None and callable(getattr(compiled, "__getitem__", None))
                and hasattr(compiled, "function")):
            # the compiled launcher takes every argument, constexprs included, in order
            tail = tuple(constexprs[n] for n in names[len(args):])
            self._compiled[key] = (compiled, tail)


@functools.cache
def cached(kernel: Any) -> CachedLaunch:
    """The one :class:`CachedLaunch` of ``kernel`` (a ``@triton.jit`` function)."""
    return CachedLaunch(kernel)
