"""Triton kernels, one per file, and their launch front ends.

Loading convention (every module here follows it, so that ``import backends`` works on
a CPU-only install without Triton):

- A kernel module imports ``triton`` at the top and defines its ``@triton.jit``
  functions at module level (no rebinding at run time): ``wht6_tile``, ``wht6_encode``,
  ``wht6_decode_accumulate``, ``oneshot_wht6_kernel``, ``reduce_sum_kernel``,
  ``spin_hold``. Nothing imports a kernel module at package import time: a caller
  imports it where it launches (``radiance_ar.wht6``, the front ends below, the GPU tools).
- A front end is host code without a Triton import: argument checks, sizes, CPU
  references and the launch, which imports its kernel module at the first launch. It
  exists where a caller must import the name on any machine: ``oneshot_wht6`` (imported
  with ``radiance_ar.backends.oneshot_wht6``), ``reduce_sum`` (its CPU reference serves CPU worlds),
  ``wht6_launch`` (launch shapes and the codec's level table), ``pointers``.
"""
