"""Triton kernels, one per file, and their launch front ends.

Loading convention (every module here follows it, and the codec's kernels in
:mod:`radiance_ar.wht6` and the launch helpers in :mod:`radiance_ar.launch` alike, so that
``import radiance_ar.backends`` works on a CPU-only install without Triton):

- A kernel module imports ``triton`` at the top and defines its ``@triton.jit``
  functions at module level (no rebinding at run time): here ``oneshot_wht6_kernel``,
  ``reduce_sum_kernel`` and ``spin_hold``. Nothing imports a kernel module at package
  import time: a caller imports it where it launches (``radiance_ar.wht6``, the front ends
  below, the GPU tools).
- A front end is host code without a Triton import: argument checks, sizes, CPU
  references and the launch, which imports its kernel module at the first launch. It
  exists where a caller must import the name on any machine: ``oneshot_wht6`` (imported
  with ``radiance_ar.backends.oneshot_wht6``) and ``reduce_sum`` (its CPU reference serves CPU
  worlds) here.
"""
