"""Where one replayed op call's host time goes: total, graph.replay alone, the x copy,
the out allocation + copy, the rest (Python); and the graph's node count by type."""
import json, statistics, sys, time, torch
from radiance_ar import overlap
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.harness.host import freeze_heap
from radiance_ar.overlap.op import forward

replay_us = []
orig = torch.cuda.CUDAGraph.replay
def timed_replay(self):
    t0 = time.perf_counter(); orig(self); replay_us.append((time.perf_counter() - t0) * 1e6)
torch.cuda.CUDAGraph.replay = timed_replay
_Graph = torch.cuda.CUDAGraph
class KeptGraph(_Graph):
    def __new__(cls, keep_graph=False):
        return super().__new__(cls, True)
    def __init__(self, keep_graph=False):
        super().__init__(True)
import os
if os.environ.get('NODES'):
    torch.cuda.CUDAGraph = KeptGraph
import cProfile, pstats, io

def node_types(graph):
    try:
        from cuda.bindings import runtime as rt_
        g = graph.raw_cuda_graph()
        err, _, n = rt_.cudaGraphGetNodes(g, numNodes=0)
        err, nodes, n = rt_.cudaGraphGetNodes(g, numNodes=n)
        kinds = {}
        for nd in nodes:
            e, t = rt_.cudaGraphNodeGetType(nd)
            kinds[str(t).split(".")[-1]] = kinds.get(str(t).split(".")[-1], 0) + 1
        return n, kinds
    except Exception as e:
        return -1, {"error": repr(e)[:200]}

recs = []
dev = torch.device("cuda", 0)
for name in sys.argv[2].split(","):
    for W in (2, 4):
        for S in (2, 4, 8):
            world = emulated_worlds(W, dev)[0]
            rt = overlap.build(world, OverlapSettings(True, name, 1, S, BackendSettings.from_env()))
            be = rt.backend
            rows, cols, k = 8192, 5120, 4352
            be.ensure_capacity(rows, cols, torch.bfloat16); be.fill_passive_peers()
            x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
            w = torch.randn(cols, k, device=dev).to(torch.bfloat16)
            call = lambda: forward(rt, x, w, None, "bf16")
            freeze_heap()
            for _ in range(5): call()
            torch.cuda.synchronize()
            replay_us.clear(); host = []
            for _ in range(50):
                torch.cuda.synchronize()
                t0 = time.perf_counter(); call(); host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize(); be.check()
            g = rt.graphs()
            entry = next(iter(g._entries.values())) if g is not None and g._entries else None
            xc, oc = [], []
            if entry is not None:
                for _ in range(50):
                    torch.cuda.synchronize(); t0 = time.perf_counter(); entry.x.copy_(x); xc.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize(); t0 = time.perf_counter()
                    o = torch.empty((rows, cols), dtype=x.dtype, device=dev); o.copy_(entry.out)
                    oc.append((time.perf_counter() - t0) * 1e6)
                n, kinds = node_types(entry.graph)
            else:
                n, kinds = 0, {}
            med = lambda v: statistics.median(v) if v else None
            rec = {"backend": name, "W": W, "S": S, "host_us": med(host), "replay_us": med(replay_us),
                   "x_copy_us": med(xc), "out_alloc_copy_us": med(oc), "nodes": n, "node_types": kinds,
                   "replays": len(replay_us)}
            rec["python_us"] = (rec["host_us"] - (rec["replay_us"] or 0) - (rec["x_copy_us"] or 0)
                                - (rec["out_alloc_copy_us"] or 0))
            if name == "sdma_wht6" and W == 2 and S == 4:
                prof = cProfile.Profile()
                for _ in range(30):
                    torch.cuda.synchronize(); prof.enable(); call(); prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO(); pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
                rec["profile_cumulative"] = text.getvalue()
                text = io.StringIO(); pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
                rec["profile_tottime"] = text.getvalue()
            print({k: v for k, v in rec.items() if not k.startswith("profile")}, flush=True); recs.append(rec)
            rt.close()
json.dump(recs, open(sys.argv[1], "w"), indent=1)
