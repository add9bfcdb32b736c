"""Instructions per value of the wht6 kernels, from an offline sm_90 compile (no GPU).

The codec kernels are bound by instruction issue (an Nsight Compute profile on an H200:
75% of issue slots busy, ALU the busiest pipe; tools/results/2026-12-03-h200-codec-profile/),
so the count of SASS instructions on their hot path predicts their speed, and a rewrite
can be judged before any device time is spent. This compiles a kernel with Triton's
own ``ptxas`` for sm_90 (the wheel ships it; CPU-only machines included), with the
arguments specialized as the JIT does at 8192x5120 (every pointer and integer divisible
by 16), disassembles it with ``nvdisasm`` and counts the opcodes up to the first EXIT:
the path every program runs (the slow paths of division and sqrt sit after it).

    python -m radiance_ar.diagnostics.sass_count            # encode and decode-accumulate
    python -m radiance_ar.diagnostics.sass_count --kernel decode_accumulate

Triton 3.6 is the version measured on the H200; other versions may compile differently.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

#: per kernel: (module, function, signature, constexprs, num_warps, values per thread)
KERNELS = {
    "encode": ("wht6_encode", "wht6_encode_kernel",
               {"x_ptr": "*bf16", "pay_ptr": "*u8", "n_sub": "i32", "subs_per_row": "i32",
                "x_row_stride": "i32", "pay_row_bytes": "i32", "row_magic": "i32",
                "row_shift": "i32", "T": "constexpr",
                "NV_SQRT": "constexpr", "WORDS": "constexpr"},
               {"T": 32, "NV_SQRT": True, "WORDS": True}, 1, 32),
    "decode_accumulate": ("wht6_decode_accumulate", "wht6_decode_accumulate_kernel",
                          {**{f"p{i}": "*u8" for i in range(8)}, "out_ptr": "*bf16",
                           "levels": "*fp32", "n_sub": "i32", "subs_per_row": "i32",
                           "out_row_stride": "i32", "pay_row_bytes": "i32",
                           "n_payloads": "i32", "T": "constexpr"},
                          {"T": 32}, 1, 32),
}
#: what the count covers where it is not one pass over the values
NOTES = {"decode_accumulate": " (the first payload, one iteration of the payload loop, the "
                              "rotation back and the store)"}
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def compile_sass(kernel: str) -> str:
    """The sm_90 SASS of ``kernel`` (a key of :data:`KERNELS`)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, signature, constexprs, warps, _ = KERNELS[kernel]
    fn = getattr(importlib.import_module(f"radiance_ar.wht6.{module}"), name)
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, t in enumerate(signature.values()) if t != "constexpr"}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                        attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "enable_fp_fusion": False})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                              check=True).stdout


def hot_path_opcodes(sass: str) -> collections.Counter:
    """Opcode counts (without modifiers) from the first instruction to the first EXIT."""
    counts: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = _OPCODE.search(line)
        if m:
            counts[m.group(1)] += 1
            if m.group(1) == "EXIT":
                break
    return counts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=sorted(KERNELS), action="append",
                   help="kernel to count (repeatable; default: all)")
    args = p.parse_args(argv)
    for kernel in args.kernel or sorted(KERNELS):
        counts = hot_path_opcodes(compile_sass(kernel))
        total, per_thread = sum(counts.values()), KERNELS[kernel][5]
        print(f"{kernel}: {total} instructions per warp on the hot path, "
              f"{total / per_thread:.1f} per value{NOTES.get(kernel, '')}")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))


if __name__ == "__main__":
    main()
