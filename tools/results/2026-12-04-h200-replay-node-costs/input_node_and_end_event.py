"""Throwaway (session 6): (1) host cost of external event-record nodes in a replayed graph;
(2) retargeting a captured D2D copy node per replay (cudaGraphExecMemcpyNodeSetParams1D /
cudaGraphExecMemcpyNodeSetParams), its host cost against torch's copy_."""
import json, os, statistics, sys, time
import torch
from cuda.bindings import runtime as cudart

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
res = {}

def host_us(fn, n=200, sync=True):
    ts = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(ts[10:]), 2)

def captured(build):
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(s):
        g.capture_begin(capture_error_mode="thread_local")
        build()
        g.capture_end()
    g.instantiate()
    g.replay(); torch.cuda.synchronize()
    return g

# (1) event record nodes
t = torch.zeros(1, device=dev)
row = {}
for n in (8, 128):
    evs = [torch.cuda.Event(external=True) for _ in range(n)]
    def build():
        for e in evs:
            t.add_(1)
            e.record()
    g = captured(build)
    row[n] = host_us(g.replay)
    err, _, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), 0)
    err, nodes, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), cnt)
    row[f"kinds_{n}"] = sorted({cudart.cudaGraphNodeGetType(nd)[1].name for nd in nodes})
    row[f"query_after_{n}"] = evs[-1].query()
row["us_per_event_node"] = (row[128] - row[8]) / 120
res["event_nodes"] = row
print(row, flush=True)

# (2) retarget a copy node
n = 8192 * 4352
x = torch.randn(n, device=dev).to(torch.bfloat16); other = torch.randn(n, device=dev).to(torch.bfloat16)
xs = torch.zeros_like(x); y = torch.zeros_like(x)
def build():
    xs.copy_(x)
    y.copy_(xs)
g = captured(build)
err, _, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), 0)
err, nodes, cnt = cudart.cudaGraphGetNodes(g.raw_cuda_graph(), cnt)
kinds = [cudart.cudaGraphNodeGetType(nd)[1].name for nd in nodes]
row = {"kinds": kinds}
ex = g.raw_cuda_graph_exec()
mem = nodes[kinds.index("cudaGraphNodeTypeMemcpy")]
r = cudart.cudaGraphMemcpyNodeGetParams(mem)
row["get_rc"] = int(r[0])
p = r[1]
row["src_ptr_matches"] = int(p.srcPtr.ptr) == x.data_ptr()
row["kind"] = str(p.kind)
for kname in ("cudaMemcpyDeviceToDevice", "cudaMemcpyDefault"):
    rr = cudart.cudaGraphExecMemcpyNodeSetParams1D(ex, mem, xs.data_ptr(), other.data_ptr(), 2 * n,
                                                   getattr(cudart.cudaMemcpyKind, kname))
    row["set1d_" + kname] = int(rr[0])
p.srcPtr = cudart.make_cudaPitchedPtr(other.data_ptr(), p.srcPtr.pitch, p.srcPtr.xsize, p.srcPtr.ysize)
rr = cudart.cudaGraphExecMemcpyNodeSetParams(ex, mem, p)
row["set3d_rc"] = int(rr[0])
g.replay(); torch.cuda.synchronize()
row["retarget_took"] = bool(torch.equal(y, other))
row["set3d_us"] = host_us(lambda: cudart.cudaGraphExecMemcpyNodeSetParams(ex, mem, p), sync=False)
row["torch_copy_us_sync"] = host_us(lambda: xs.copy_(x))
row["torch_copy_us"] = host_us(lambda: xs.copy_(x), sync=False)
kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
st = torch.cuda.current_stream().cuda_stream
row["cudart_copy_us"] = host_us(lambda: cudart.cudaMemcpyAsync(xs.data_ptr(), x.data_ptr(), 2 * n, kind, st), sync=False)
row["set1d_us"] = host_us(lambda: cudart.cudaGraphExecMemcpyNodeSetParams1D(ex, mem, xs.data_ptr(), x.data_ptr(), 2 * n, kind), sync=False)
row["replay_us"] = host_us(g.replay)
res["retarget"] = row
print(row, flush=True)
json.dump(res, open(f"{OUT}/probe2.json", "w"), indent=1)
