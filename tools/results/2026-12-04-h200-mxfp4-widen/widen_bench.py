"""Variants of the MXFP4 -> e4m3 widening: bits against the shipped kernel, and time."""
import os, sys, statistics
sys.path.insert(0, os.environ.get("H32", "."))
import torch, triton, triton.language as tl
from radiance_ar.overlap.kernels import mxfp4_widen_fp8 as wf
from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fk


@triton.jit
def _byte(code, e):
    m = code & 7
    normal_code = m >= 2
    x = tl.where(normal_code, (m >> 1) - 1, -1)
    mant = tl.where(normal_code, (m & 1) << 2, 0)
    f = x + e + 7
    sub = (8 | mant) >> tl.minimum(tl.maximum(1 - f, 0), 3)
    byte = tl.where(f >= 1, (f << 3) | mant, sub)
    return tl.where(m == 0, 0, byte) | ((code & 8) << 4)


@triton.jit
def widen16(w_ptr, ws_ptr, top_ptr, out_ptr, N, K, w_rs, ws_rs, out_rs,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """one int16 store per packed byte: lo | hi << 8 (little-endian: element 2j first)"""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    load_n = tl.minimum(offs_n, N - 1)
    offs_kb = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    in_k = offs_kb[None, :] < K // 2
    w = tl.load(w_ptr + load_n[:, None] * w_rs + offs_kb[None, :], mask=in_k, other=0).to(tl.int32)
    ws = tl.load(ws_ptr + load_n[:, None] * ws_rs + (offs_kb // 16)[None, :], mask=in_k, other=127).to(tl.int32)
    top = tl.load(top_ptr + load_n)
    e = tl.minimum(tl.maximum(ws - top[:, None], -14), 0) + 6
    pair = _byte(w & 0xF, e) | (_byte(w >> 4, e) << 8)
    mask = (offs_n[:, None] < N) & in_k
    tl.store(out_ptr + offs_n[:, None] * (out_rs // 2) + offs_kb[None, :], pair.to(tl.int16), mask=mask)


@triton.jit
def widen32(w_ptr, ws_ptr, top_ptr, out_ptr, N, K, w_rs, ws_rs, out_rs,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """one int32 store per two packed bytes, loaded as int16"""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    load_n = tl.minimum(offs_n, N - 1)
    offs_kh = tl.program_id(1) * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)  # int16 words
    in_k = offs_kh[None, :] < K // 4
    w = tl.load(w_ptr + load_n[:, None] * (w_rs // 2) + offs_kh[None, :], mask=in_k, other=0).to(tl.int32) & 0xFFFF
    ws = tl.load(ws_ptr + load_n[:, None] * ws_rs + (offs_kh // 8)[None, :], mask=in_k, other=127).to(tl.int32)
    top = tl.load(top_ptr + load_n)
    e = tl.minimum(tl.maximum(ws - top[:, None], -14), 0) + 6
    quad = (_byte(w & 0xF, e) | (_byte((w >> 4) & 0xF, e) << 8) | (_byte((w >> 8) & 0xF, e) << 16)
            | (_byte((w >> 12) & 0xF, e) << 24))
    mask = (offs_n[:, None] < N) & in_k
    tl.store(out_ptr + offs_n[:, None] * (out_rs // 4) + offs_kh[None, :], quad, mask=mask)


def run(kern, w, ws, top, out, view, bn, bk, nw):
    n, k = out.shape
    kern[(triton.cdiv(n, bn), triton.cdiv(k, bk))](w if kern is not widen32 else w.view(torch.int16), ws, top,
         out.view(view), n, k, w.stride(0), ws.stride(0), out.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)


def timed(fn, reps=30):
    ts = []
    for i in range(reps + 5):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts[5:])


dev = "cuda" if torch.cuda.is_available() else "cpu"
shapes = [(5120, 4352), (8192, 7168), (4096, 2048)] if dev == "cuda" else [(64, 128)]
g = torch.Generator().manual_seed(0)
for n, k in shapes:
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).to(dev)
    scales = torch.randint(118, 128, (n, k // 32), generator=g, dtype=torch.uint8).to(dev)
    plan = fk.plan_columns(packed, scales)
    ref = wf.widen(packed, scales, plan.top)
    nbytes = n * k * 1.5 + n * k / 32
    if dev == "cuda":
        ms = timed(lambda: wf.widen(packed, scales, plan.top, out=ref))
        print(f"{n}x{k} shipped  {ms:.4f} ms {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
    for kern, view in ((widen16, torch.int16), (widen32, torch.int32)):
        for bn, bk, nw in ((32, 512, 4), (16, 1024, 4), (64, 256, 4), (8, 2048, 8), (32, 1024, 8)):
            out = torch.full((n, k), 0x7F, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
            run(kern, packed, scales, plan.top, out, view, bn, bk, nw)
            same = bool(torch.equal(out.view(torch.uint8), ref.view(torch.uint8)))
            line = f"{n}x{k} {kern.__name__} {bn}x{bk} w{nw} same={same}"
            if dev == "cuda":
                ms = timed(lambda: run(kern, packed, scales, plan.top, out, view, bn, bk, nw))
                line += f" {ms:.4f} ms {nbytes / ms / 1e6:7.0f} GB/s"
            print(line, flush=True)
            if dev == "cpu":
                break
