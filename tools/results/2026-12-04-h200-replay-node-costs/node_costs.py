"""Throwaway (session 6): (A) host cost of graph.replay per node type; (B) cuBLASLt +
SM carve-out against the codec's contention; (C) host cost of binding x/out by node
parameter updates against torch copies."""
import json, os, statistics, sys, time, traceback
sys.path.insert(0, "tools")
import torch
from cuda.bindings import runtime as cudart, driver

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
res = {}


def host_us(fn, n=60):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts[5:])


def graph_of(build):
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(s):
        build()  # warm
        torch.cuda.synchronize()
        g.capture_begin(capture_error_mode="thread_local")
        build()
        g.capture_end()
    g.replay(); torch.cuda.synchronize()
    return g


def part_a():
    t = torch.zeros(1, device=dev)
    a = torch.zeros(1 << 18, device=dev); b = torch.zeros_like(a)
    pin = torch.zeros(1 << 18, pin_memory=True)
    word = torch.zeros(64, dtype=torch.int32, device=dev)
    hostword = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    side = torch.cuda.Stream()
    evs = [torch.cuda.Event() for _ in range(300)]

    def kernels(n):
        for _ in range(n): t.add_(1)

    def d2d(n):
        for _ in range(n): b.copy_(a)

    def h2d(n):
        for _ in range(n): b.copy_(pin, non_blocking=True)

    def memop(n):
        st = torch.cuda.current_stream().cuda_stream
        for i in range(n):
            driver.cuStreamWriteValue32(st, hostword.data_ptr() + 4 * (i % 64), i + 1, 0)

    def copy2d(n):
        st = torch.cuda.current_stream().cuda_stream
        for _ in range(n):
            cudart.cudaMemcpy2DAsync(b.data_ptr(), 4096, pin.data_ptr(), 8192, 4096, 3,
                                     cudart.cudaMemcpyKind.cudaMemcpyDefault, st)

    def forked(n):  # n H2D copies alternating between the capture stream and a side stream
        cur = torch.cuda.current_stream()
        for i in range(n):
            if i % 2:
                e = evs[i]; e.record(cur); side.wait_event(e)
                with torch.cuda.stream(side):
                    b.copy_(pin, non_blocking=True)
                e2 = evs[i + 1]; e2.record(side); cur.wait_event(e2)
            else:
                b.copy_(pin, non_blocking=True)

    out = {}
    for name, fn in [("kernel", kernels), ("d2d", d2d), ("h2d", h2d), ("memop", memop),
                     ("copy2d", copy2d), ("h2d_forked", forked)]:
        row = {}
        for n in (8, 32, 128):
            try:
                g = graph_of(lambda: fn(n))
                row[n] = host_us(g.replay)
            except Exception as e:
                row[n] = repr(e)[:200]
        try:
            row["us_per_node"] = (row[128] - row[8]) / 120
        except Exception:
            pass
        out[name] = row
        print(name, row, flush=True)
    res["A_replay_host_us"] = out


def part_c():
    n = 8192 * 4352
    x = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    xs = torch.zeros_like(x)
    out = {}
    out["torch_copy_us"] = host_us(lambda: xs.copy_(x))
    st = torch.cuda.current_stream().cuda_stream
    kind = cudart.cudaMemcpyKind.cudaMemcpyDefault
    out["cudart_copy_us"] = host_us(lambda: cudart.cudaMemcpyAsync(xs.data_ptr(), x.data_ptr(), 2 * n, kind, st))
    out["torch_empty_us"] = host_us(lambda: torch.empty(8192, 5120, dtype=torch.bfloat16, device=dev))
    # a graph whose first node copies x -> xs; retarget its source per call
    src2 = torch.ones_like(x)
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(s):
        g.capture_begin(capture_error_mode="thread_local")
        xs.copy_(x)
        xs.mul_(2)
        g.capture_end()
    g.instantiate() if hasattr(g, "instantiate") else None
    g.replay(); torch.cuda.synchronize()
    err, _, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), 0)
    err, nodes, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), cnt)
    kinds = [cudart.cudaGraphNodeGetType(nd)[1].name for nd in nodes]
    out["kinds"] = kinds
    mem = [nd for nd, k in zip(nodes, kinds) if "Memcpy" in k][0]
    ex = g.raw_cuda_graph_exec()
    def setp():
        r = cudart.cudaGraphExecMemcpyNodeSetParams1D(ex, mem, xs.data_ptr(), src2.data_ptr(), 2 * n, kind)
        assert int(r[0]) == 0, r
    out["setparams_us"] = host_us(setp)
    g.replay(); torch.cuda.synchronize()
    out["setparams_took"] = bool((xs[:4].float() == 2).all())
    res["C_bind"] = out
    print(out, flush=True)


def part_b():
    from radiance_ar import overlap
    from radiance_ar.envs import BackendSettings
    from radiance_ar.transport.world import emulated_worlds
    from radiance_ar.overlap.config import OverlapSettings
    from radiance_ar.overlap.op import forward
    import gpu_timing, producer_inputs
    from world_measure import Case, shard
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for carve in (0, 16, 32):
            torch._C._set_sm_carveout_experimental(carve)
            for W, backend, S in [(2, "sdma_wht6", 4), (2, "sdma_wht6", 1)]:
                case = Case(backend, 8192, 5120, 4352, S, 20, 3)
                world = emulated_worlds(W, dev)[0]
                rt = overlap.build(world, OverlapSettings(True, backend, 1, S, BackendSettings.from_env()))
                ops = producer_inputs.operands("bf16", *shard(case, 0, dev))
                rt.backend.ensure_capacity(8192, 5120, torch.bfloat16)
                rt.backend.fill_passive_peers()
                fn = lambda i: forward(rt, ops.x, ops.weight, ops.weight_scale, "bf16")
                s = gpu_timing.event_times(fn, 20, 3)
                y = torch.empty(8192, 5120, dtype=torch.bfloat16, device=dev)
                gm = gpu_timing.event_times(lambda i: torch.mm(ops.x, ops.weight.t(), out=y), 20, 3)
                rec = dict(lib=lib, carve=carve, W=W, S=S, backend=backend, ms=statistics.median(s),
                           spread=(max(s) - min(s)) / 2, gemm_ms=statistics.median(gm))
                print(json.dumps(rec), flush=True)
                rows.append(rec)
                rt.close()
        torch._C._set_sm_carveout_experimental(0)
    torch.backends.cuda.preferred_blas_library("cublas")
    res["B_carveout"] = rows


def part_d():
    out = {}
    dword = torch.zeros(64, dtype=torch.int32, device=dev)
    hword = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    big = torch.zeros(1 << 22, device=dev); pin = torch.zeros(1 << 22, pin_memory=True)
    def memop_to(buf, n):
        st = torch.cuda.current_stream().cuda_stream
        for i in range(n):
            driver.cuStreamWriteValue32(st, buf.data_ptr() + 4 * (i % 64), i + 1, 0)
    def waitop(buf, n):
        st = torch.cuda.current_stream().cuda_stream
        for i in range(n):
            driver.cuStreamWaitValue32(st, buf.data_ptr(), 0, 1)  # GEQ 0: passes at once
    def d2h(n):
        for _ in range(n): pin.copy_(big, non_blocking=True)
    for name, fn in [("memop_dev", lambda n: memop_to(dword, n)), ("memop_host", lambda n: memop_to(hword, n)),
                     ("wait_dev", lambda n: waitop(dword, n)), ("wait_host", lambda n: waitop(hword, n)),
                     ("d2h", d2h)]:
        row = {}
        for n in (8, 128):
            try:
                g = graph_of(lambda: fn(n))
                row[n] = host_us(g.replay)
                if n == 128:
                    st = torch.cuda.current_stream().cuda_stream
                    ex = g.raw_cuda_graph_exec()
                    row["upload_rc"] = int(cudart.cudaGraphUpload(ex, st)[0]); torch.cuda.synchronize()
                    row["after_upload"] = host_us(g.replay)
                    row["cudart_launch"] = host_us(lambda: cudart.cudaGraphLaunch(ex, st))
            except Exception as e:
                row[n] = repr(e)[:300]
        try:
            row["us_per_node"] = (row[128] - row[8]) / 120
        except Exception:
            pass
        out[name] = row
        print(name, row, flush=True)
    # setparams: the kinds, and both entry points
    n = 1 << 20
    x = torch.zeros(n, dtype=torch.bfloat16, device=dev); xs = torch.zeros_like(x); src2 = torch.ones_like(x)
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(s):
        g.capture_begin(capture_error_mode="thread_local")
        xs.copy_(x)
        g.capture_end()
    g.instantiate()
    err, _, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), 0)
    err, nodes, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), cnt)
    mem = nodes[0]
    out["node_kind"] = cudart.cudaGraphNodeGetType(mem)[1].name
    r = cudart.cudaGraphMemcpyNodeGetParams(mem)
    out["get_rc"] = int(r[0])
    ex = g.raw_cuda_graph_exec()
    for kname in ("cudaMemcpyDeviceToDevice", "cudaMemcpyDefault"):
        kind = getattr(cudart.cudaMemcpyKind, kname)
        rr = cudart.cudaGraphExecMemcpyNodeSetParams1D(ex, mem, xs.data_ptr(), src2.data_ptr(), 2 * n, kind)
        out["set1d_" + kname] = int(rr[0])
    try:
        p3 = r[1]
        p3.srcPtr = cudart.make_cudaPitchedPtr(src2.data_ptr(), 2 * n, 2 * n, 1)
        rr = cudart.cudaGraphExecMemcpyNodeSetParams(ex, mem, p3)
        out["set3d"] = int(rr[0])
        out["set3d_us"] = host_us(lambda: cudart.cudaGraphExecMemcpyNodeSetParams(ex, mem, p3))
        g.replay(); torch.cuda.synchronize()
        out["set3d_took"] = bool((xs[:4].float() == 1).all())
    except Exception as e:
        out["set3d_err"] = repr(e)[:300]
    res["D"] = out
    print(out, flush=True)


for part in sys.argv[1].split(","):
    try:
        {"a": part_a, "b": part_b, "c": part_c, "d": part_d}[part]()
    except Exception:
        traceback.print_exc()
        res[f"{part}_error"] = traceback.format_exc()[-2000:]
    json.dump(res, open(f"{OUT}/s6_probe.json", "w"), indent=1)
