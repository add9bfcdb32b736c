"""Device time of the quantizer without its host launch cost: 8 calls on x rotated over
copies beyond the L2, captured in one CUDA graph, replayed; median per call over 30
replays. Beside it a device copy of the same bytes the same way, and the host time of
one eager launch."""
import json, statistics, sys, time, torch
from radiance_ar.overlap.kernels import quantize_fp8_rows as qk
from radiance_ar.overlap import producer_mxfp4 as mx

def graph_ms(fn, calls=8, reps=30):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(calls): fn(i)  # warm (compile) outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls): fn(i)
    ts = []
    for _ in range(reps + 3):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / calls)
    return statistics.median(ts[3:]), (statistics.quantiles(ts[3:], n=4)[2] - statistics.quantiles(ts[3:], n=4)[0]) / 2

recs = []
for rows, k in ((8192, 4352), (8192, 7168), (16384, 4352), (2048, 4352), (4096, 3584), (8192, 8192)):
    copies = 8
    xs = [torch.randn(rows, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    rq, rs = mx.quantize_activation(xs[0])
    q, s = qk.quantize_fp8_rows(xs[0])
    same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    ms, spread = graph_ms(lambda i: qk.quantize_fp8_rows(xs[i % copies], out=q, scale_out=s))
    nbytes = rows * k * 3 + rows * 4
    srcs = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(copies)]
    dst = torch.empty_like(srcs[0])
    cms, cspread = graph_ms(lambda i: dst.copy_(srcs[i % copies]))
    torch.cuda.synchronize()
    host = []
    for _ in range(50):
        t0 = time.perf_counter(); qk.quantize_fp8_rows(xs[0], out=q, scale_out=s); host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    ref_ms, _ = graph_ms(lambda i: mx.quantize_activation(xs[i % copies]), calls=4, reps=10)
    rec = {"rows": rows, "k": k, "ms": ms, "spread_ms": spread, "copy_ms": cms, "fraction_of_copy": cms / ms,
           "gb_per_s": nbytes / ms / 1e6, "same_bits": same, "host_us_per_eager_launch": statistics.median(host),
           "torch_reference_ms": ref_ms}
    print(rec, flush=True); recs.append(rec)
json.dump({"method": __doc__, "gpu": torch.cuda.get_device_name(), "records": recs}, open(sys.argv[1], "w"), indent=1)
