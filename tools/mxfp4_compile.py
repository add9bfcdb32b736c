"""``tools/bench_mxfp4.py --compile-only``: the mxfp4 GEMM kernels compiled for a target
with the installed Triton, no GPU needed: shared memory, and for CUDA targets ptxas'
registers, spills and whether it serialized the wgmma pipeline (C7515)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Callable

import torch

from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fp8_kernel
from radiance_ar.overlap.kernels import mxfp4_w4a8 as kernel

BF16 = torch.bfloat16


def compile_only(arch: str, candidates, label: Callable) -> list[dict]:
    """Compile each candidate (config, activation dtype) of the bf16-widening kernel for
    ``arch`` (``90``, ``100``, ``gfx950``) with the installed Triton (no GPU), and on CUDA
    targets the fp8 kernel's table configs; each row named by ``label(cfg, x_dtype)``."""
    from triton.backends.compiler import GPUTarget

    hip = not arch.isdigit()
    target = GPUTarget("hip", arch, 64) if hip else GPUTarget("cuda", int(arch), 32)
    common = {"rows": "i32", "N": "i32", "K": "i32", "x_row_stride": "i32",
              "w_row_stride": "i32", "ws_row_stride": "i32", "out_row_stride": "i32"}
    rows = []
    for cfg, x_dtype in candidates:
        sig = {"x_ptr": "*bf16" if x_dtype == BF16 else "*fp8e4nv", "xs_ptr": "*fp32",
               "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16", **common}
        const = {"X_FORMAT": "bf16" if x_dtype == BF16 else "e4m3", "W_LHS": cfg.w_lhs,
                 "DEQUANT": cfg.dequant, "DOT_FP32": False, "EVEN_K": True,
                 "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                 "GROUP_M": cfg.group_m}
        rows.append(_compiled(label(cfg, x_dtype), kernel._kernel(), sig, const, cfg, target))
    if hip:
        return rows
    named = {"DEFAULT_CONFIG": fp8_kernel.DEFAULT_CONFIG, "MEDIUM_CONFIG": fp8_kernel.MEDIUM_CONFIG,
             **{f"CONFIGS[{n}, {k}]": c for (n, k), c in fp8_kernel.CONFIGS.items()}}
    for name, cfg in named.items():
        sig = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*u8",
               "top_ptr": "*i32", "cs_ptr": "*fp32", "out_ptr": "*bf16", **common}
        const = {"W_LHS": cfg.w_lhs, "PROMOTE_K": cfg.promote_k or None, "DOT_FP32": False,
                 "WIDEN_ASM": cfg.widen_asm, "EVEN_K": True, "BLOCK_M": cfg.block_m,
                 "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}
        rows.append(_compiled(f"mxfp4_fp8_gemm {name}", fp8_kernel._kernel(), sig, const, cfg,
                              target))
    return rows


def _compiled(name: str, fn, sig: dict, const: dict, cfg, target) -> dict:
    """One compile's row: shared memory, and on CUDA ptxas' report (or the error)."""
    import triton

    # As a launch specializes them: 16-divisible pointers, N, K and strides (K / 32 =
    # ws_row_stride is 8-divisible only at K = 4352; left unmarked).
    aligned = [i for i, a in enumerate(sig) if a not in ("rows", "ws_row_stride")]
    src = triton.compiler.ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}},
                                    constexprs=const,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    row = {"kernel": name}
    try:
        compiled = triton.compile(src, target=target, options={
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    except Exception as e:  # a config this Triton cannot compile: listed, not fatal
        return dict(row, error=f"{type(e).__name__}: {str(e)[:200]}")
    row["shared_bytes"] = compiled.metadata.shared
    if target.backend == "cuda":
        row.update(_ptxas_report(compiled.asm["ptx"], target.arch))
    return row


def _ptxas_report(ptx: str, arch: int) -> dict:
    """ptxas -v on Triton's PTX, with the ptxas Triton itself uses for ``arch``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", path,
                              "-o", path + ".cubin"], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "wgmma_serialized": "C7515" in res.stderr}
