"""The shipped quantizer against cache-hint and warp variants, timed as bench_mxfp4 times
it (x rotated over copies beyond the L2, 4 calls a sample), 8192 x 4352 and 8192 x 7168."""
import importlib.util, json, sys, torch
sys.path.insert(0, "tools")
import gpu_timing, metrics
from radiance_ar.overlap.kernels import quantize_fp8_rows as qk
from radiance_ar.overlap import producer_mxfp4 as mx
import radiance_ar.overlap.kernels.quantize_fp8_rows as src_mod

def variant(name, loads, stores):
    src = open(src_mod.__file__).read()
    if loads:
        src = src.replace("other=0.0)", "other=0.0, eviction_policy='evict_first')")
    if stores:
        src = src.replace("mask=offs < K)", "mask=offs < K, cache_modifier='.cs')") \
                 .replace("mask=offs_t < K)", "mask=offs_t < K, cache_modifier='.cs')")
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec); mod.__file__ = src_mod.__file__
    exec(compile(src, src_mod.__file__, "exec"), mod.__dict__)
    return mod

def timed(fn):
    return metrics.median_and_spread(gpu_timing.event_times(fn, 30, 5))

mods = {"shipped": qk, "evict_first loads": variant("a", True, False),
        "streaming stores": variant("b", False, True), "both": variant("c", True, True)}
recs = []
for rows, k in ((8192, 4352), (8192, 7168), (16384, 4352)):
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    copies = gpu_timing.copies_for(x)
    xs = [x] + [x.clone() for _ in range(copies - 1)]
    rq, rs = mx.quantize_activation(x)
    nbytes = rows * k * 3 + rows * 4
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    cs = [src] + [src.clone() for _ in range(gpu_timing.copies_for(src) - 1)]
    dst = torch.empty_like(src)
    copy_ms = timed(lambda i: dst.copy_(cs[i % len(cs)]))[0]
    for name, mod in mods.items():
        q, s = mod.quantize_fp8_rows(x)
        same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        ms, spread = timed(lambda i: mod.quantize_fp8_rows(xs[i % copies], out=q, scale_out=s))
        rec = {"rows": rows, "k": k, "variant": name, "ms": ms, "spread": spread, "copy_ms": copy_ms,
               "fraction_of_copy": copy_ms / ms, "same_bits": same}
        print(rec, flush=True); recs.append(rec)
json.dump(recs, open(sys.argv[1], "w"), indent=1)
