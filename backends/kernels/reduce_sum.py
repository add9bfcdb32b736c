"""Local reduce of the sdma backend: ``out = round(sum_{w=0..W-1} fp32(x_w))``.

Math. For W equally shaped contiguous inputs x_0..x_{W-1} (bf16, fp16 or fp32) and every
element i::

    acc_i = fp32(x_0[i])
    acc_i = acc_i + fp32(x_w[i])        for w = 1, ..., W-1, in this order (IEEE fp32 adds)
    out[i] = round_to_nearest_even(acc_i, dtype of out)     (and ``also[i]``, if given)

The order is fixed (rank order), the accumulator is fp32 and the result is rounded once,
so every rank that sums the same inputs gets the same bits, on the GPU (this kernel)
and on the CPU (:func:`reference_reduce_sum`, the same adds in the same order). No
multiply is involved, so no fused multiply-add can change a rounding.

Work: one pass, W reads and one (or two) writes per element: memory-bound. A few
persistent CTAs (2 per SM by default) walk the flat index space in BLOCK-element
steps (grid-stride), each thread holding 16-byte vectors, which is what it takes to
reach HBM bandwidth without flooding the machine with CTAs while a GEMM runs beside it.

Triton is imported at the first launch (never at module import): this module imports
on a CPU-only machine without Triton. Set ``TRITON_INTERPRET=1`` before the first
launch to run the kernel on CPU tensors (tests do, in a subprocess).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

MAX_INPUTS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 2048  # elements per step: 256 threads (8 warps) x 8 bf16 = one 16-byte vector each
NUM_WARPS = 8

tl: Any = None  # triton.language, bound by _kernel() at the first launch
_jitted: Any = None


def _reduce_sum_kernel(
    x0, x1, x2, x3, x4, x5, x6, x7,  # input pointers in rank order; unused ones repeat x0
    out_ptr,                          # output pointer, dtype of the result
    also_ptr,                         # second output (same values) if HAS_ALSO, else = out_ptr
    n,                                # elements per input
    W: tl.constexpr,                  # number of inputs summed, 1..8
    HAS_ALSO: tl.constexpr,           # also write ``also_ptr``
    BLOCK: tl.constexpr,              # elements per program per step
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(x0 + offs, mask=mask, other=0.0).to(tl.float32)
        if W > 1:
            acc += tl.load(x1 + offs, mask=mask, other=0.0).to(tl.float32)
        if W > 2:
            acc += tl.load(x2 + offs, mask=mask, other=0.0).to(tl.float32)
        if W > 3:
            acc += tl.load(x3 + offs, mask=mask, other=0.0).to(tl.float32)
        if W > 4:
            acc += tl.load(x4 + offs, mask=mask, other=0.0).to(tl.float32)
        if W > 5:
            acc += tl.load(x5 + offs, mask=mask, other=0.0).to(tl.float32)
        if W > 6:
            acc += tl.load(x6 + offs, mask=mask, other=0.0).to(tl.float32)
        if W > 7:
            acc += tl.load(x7 + offs, mask=mask, other=0.0).to(tl.float32)
        result = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, result, mask=mask)
        if HAS_ALSO:
            tl.store(also_ptr + offs, result, mask=mask)


_POINTERS = ("x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7", "out_ptr", "also_ptr")


def _kernels() -> tuple[Any, Any]:
    """(fast, generic): fast is specialized for 16-byte aligned pointers and n % 16 == 0
    (16-byte vector loads); generic is specialized on nothing. Each compiles to ONE
    variant per (dtypes, W, HAS_ALSO), so :func:`warm_up` can load every variant a run
    will use before any stream blocks (see :func:`warm_up`)."""
    global tl, _jitted
    if _jitted is None:
        try:
            import triton
            import triton.language as language
        except ImportError as e:
            raise RuntimeError(f"reduce_sum on a GPU needs Triton: pip install triton ({e})") from None
        tl = language
        _jitted = (triton.jit(_reduce_sum_kernel),
                   triton.jit(_reduce_sum_kernel, do_not_specialize=["n"],
                              do_not_specialize_on_alignment=list(_POINTERS)))
    return _jitted


def _check(inputs: Sequence[torch.Tensor], out: torch.Tensor, also: torch.Tensor | None) -> None:
    if not isinstance(inputs, (list, tuple)) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise ValueError(f"reduce_sum: inputs must be a list of 1..{MAX_INPUTS} tensors, got "
                         f"{type(inputs).__name__} of {len(inputs) if hasattr(inputs, '__len__') else '?'}")
    for label, t in [(f"inputs[{i}]", x) for i, x in enumerate(inputs)] + [("out", out)] + (
            [("also", also)] if also is not None else []):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"reduce_sum: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"reduce_sum: {label} dtype {t.dtype}, expected one of {DTYPES}")
        if not t.is_contiguous():
            raise ValueError(f"reduce_sum: {label} must be contiguous")
        if t.numel() != out.numel():
            raise ValueError(f"reduce_sum: {label} has {t.numel()} elements, out has {out.numel()}")


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
    n = out.numel()
    if n == 0:
        return
    if ctas is None:
        ctas = (2 * torch.cuda.get_device_properties(out.device).multi_processor_count
                if out.is_cuda else 4)
    if not isinstance(ctas, int) or ctas < 1:
        raise ValueError(f"reduce_sum: ctas must be an int >= 1, got {ctas!r}")
    tensors = list(inputs) + [out] + ([also] if also is not None else [])
    aligned = n % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    kernel = _kernels()[0 if aligned else 1]
    grid = (min(ctas, -(-n // BLOCK)),)
    ptrs = list(inputs) + [inputs[0]] * (MAX_INPUTS - len(inputs))
    kernel[grid](*ptrs, out, also if also is not None else out, n,
                 W=len(inputs), HAS_ALSO=also is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


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
