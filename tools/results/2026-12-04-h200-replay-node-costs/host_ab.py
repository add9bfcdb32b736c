"""Throwaway (session 6): host time of a replayed op call, this tree against the session's
start (PYTHONPATH picks the tree): per call after a synchronize, and in a stream of calls."""
import json, os, statistics, sys, time
sys.path.insert(0, "tools")
import torch
import radiance_ar
from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
import gpu_timing, producer_inputs
from world_measure import Case, shard

OUT = os.environ.get("OUT", "/tmp"); TAG = sys.argv[1]
dev = torch.device("cuda", 0)
recs = []
for W, backend, S in [(2, "sdma_wht6", 4), (2, "sdma_wht6", 8), (4, "sdma_wht6", 4), (4, "sdma_wht6", 8),
                      (2, "sdma", 4), (2, "sdma", 8), (4, "sdma", 4), (4, "sdma", 8)]:
    case = Case(backend, 8192, 5120, 4352, S, 20, 3)
    world = emulated_worlds(W, dev)[0]
    rt = overlap.build(world, OverlapSettings(True, backend, 1, S, BackendSettings.from_env()))
    ops = producer_inputs.operands("bf16", *shard(case, 0, dev))
    rt.backend.ensure_capacity(8192, 5120, torch.bfloat16); rt.backend.fill_passive_peers()
    fn = lambda i=0: forward(rt, ops.x, ops.weight, ops.weight_scale, "bf16")
    host = []
    dev_ms = gpu_timing.event_times(fn, 20, 3, host_ms=host)
    sync = []
    for _ in range(60):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); sync.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    g = rt.graphs(); e = next(iter(g._entries.values()))
    clone = []
    for _ in range(60):
        torch.cuda.synchronize(); t0 = time.perf_counter(); e.out.clone(); clone.append((time.perf_counter() - t0) * 1e6)
    rec = dict(tree=TAG, W=W, backend=backend, S=S, device_ms=statistics.median(dev_ms),
               host_ms_stream=statistics.median(host), host_us_sync=statistics.median(sync[10:]),
               clone_us=statistics.median(clone[10:]), path=os.path.dirname(radiance_ar.__file__))
    print(json.dumps(rec), flush=True); recs.append(rec)
    rt.close()
json.dump(recs, open(f"{OUT}/ab-{TAG}.json", "w"), indent=1)
