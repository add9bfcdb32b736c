"""Launching a compiled Triton kernel again without the JIT's per-call work.

``kernel[grid](*args)`` binds the arguments, computes the specialization key (each
pointer's 16-byte alignment, each int's divisibility by 16), looks the compiled kernel
up, then asks every tensor argument for its pointer and the driver for its attributes:
32-38 us per launch of the 4-input reduce on an H200 host, as much host time as ten
copy-engine enqueues (``python -m diagnostics.host_steps``,
tools/results/2026-12-03-h200-host-steps/ and -launch-cache/). A :class:`Launcher` finds
the compiled kernel once, through Triton's own ``warmup`` (which compiles or looks it
up without launching), and then calls its launcher directly with integer addresses.

The caller owns the specialization: every launch through one Launcher must have the
properties the kernel was resolved with, so a caller keys its Launchers on them (the
reduce keys on "every pointer 16-byte aligned and n % 16 == 0", the only property its
fast variant is specialized on; its generic variant is specialized on nothing).
GPU only: the Triton interpreter has no compiled kernels.
"""

from __future__ import annotations

from typing import Any, Sequence


class Launcher:
    """One compiled variant of a Triton kernel and one grid, launched by address."""

    def __init__(self, kernel: Any, grid: tuple[int, ...], example: Sequence[Any],
                 options: dict[str, Any]):
        """``kernel``: a ``triton.jit`` function; ``example``: its positional arguments
        with every pointer as an object with ``data_ptr()`` and ``dtype``
        (:class:`backends.kernels.pointers.Address`) and the same specialization the
        launches will have; ``options``: its constexpr and launch keywords
        (``num_warps``...), in the kernel's parameter order for the constexprs."""
        compiled = kernel.warmup(*example, grid=grid, **options)
        self._run = compiled[grid]  # loads the module now if it is not loaded yet
        # The launcher takes every parameter, constexprs included (as JITFunction.run
        # passes them), so the constant tail is appended to each launch's arguments.
        names = list(kernel.arg_names)
        self._tail = tuple(options[n] for n in names[len(example):])
        if len(example) + len(self._tail) != len(names):
            raise ValueError(f"Launcher: {len(example)} positional arguments and constexprs "
                             f"{sorted(options)} do not cover the parameters {names}")

    def __call__(self, args: Sequence[Any], stream: int) -> None:
        """Launch on ``stream`` (a raw handle) with ``args`` (pointers as ints)."""
        self._run(*args, *self._tail, stream=stream)
