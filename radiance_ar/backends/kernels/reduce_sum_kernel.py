"""Local reduce of the sdma backend as a Triton kernel: ``out = round(sum_w fp32(x_w))``.

Math. For W equally shaped contiguous inputs x_0..x_{W-1} (bf16, fp16 or fp32) and every
element i::

    acc_i = fp32(x_0[i])
    acc_i = acc_i + fp32(x_w[i])        for w = 1, ..., W-1, in this order (IEEE fp32 adds)
    out[i] = round_to_nearest_even(acc_i, dtype of out)     (and ``also[i]``, if given)

The order is fixed (rank order), the accumulator is fp32 and the result is rounded once,
so every rank that sums the same inputs gets the same bits, on the GPU (this kernel)
and on the CPU (``reduce_sum.reference_reduce_sum``, the same adds in the same order).
No multiply is involved, so no fused multiply-add can change a rounding.

Work: one pass, W reads and one (or two) writes per element: memory-bound. A few
persistent CTAs (2 per SM by default) walk the flat index space in BLOCK-element
steps (grid-stride), each thread holding 16-byte vectors, which is what it takes to
reach HBM bandwidth without flooding the machine with CTAs while a GEMM runs beside it.

The host side (checks, the CPU reference, launch and warm-up) is the front end
``radiance_ar.backends.kernels.reduce_sum``, which imports this module at its first launch.
"""

import triton
import triton.language as tl


@triton.jit
def reduce_sum_kernel(
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
#: the same kernel specialized on nothing: for pointers not 16-byte aligned or n % 16 != 0
#: (the one above then gets 16-byte vector loads)
reduce_sum_kernel_generic = triton.jit(reduce_sum_kernel.fn, do_not_specialize=["n"],
                                       do_not_specialize_on_alignment=list(_POINTERS))
