"""Triton kernels of the GEMM producers, one per file.

Nothing here imports Triton at module import: a kernel module binds ``triton`` at its
first launch, so ``import radiance_ar.overlap`` works on a CPU-only install without Triton.
"""
