"""Throwaway: device timeline of replayed op calls (one active rank, passive peers)."""
import json, os, sys
sys.path.insert(0, "tools")
import torch
from torch.profiler import profile, ProfilerActivity
from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
import producer_inputs
from world_measure import Case, shard

out = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
rows = []
for W, backend, S, sched in [(4, "sdma_wht6", 1, None), (4, "sdma_wht6", 4, None),
                             (4, "sdma_wht6", 4, "twoshot"), (4, "sdma", 4, None),
                             (2, "sdma_wht6", 4, None)]:
    if sched:
        os.environ["RADIANCE_AR_SDMA_SCHEDULE"] = sched
    else:
        os.environ.pop("RADIANCE_AR_SDMA_SCHEDULE", None)
    case = Case(backend, 8192, 5120, 4352, S, 5, 2)
    world = emulated_worlds(W, dev)[0]
    rt = overlap.build(world, OverlapSettings(True, backend, 1, S, BackendSettings.from_env()))
    ops = producer_inputs.operands("bf16", *shard(case, 0, dev))
    rt.backend.ensure_capacity(8192, 5120, torch.bfloat16)
    rt.backend.fill_passive_peers()
    for _ in range(6):
        forward(rt, ops.x, ops.weight, ops.weight_scale, "bf16")
    torch.cuda.synchronize()
    reason = rt.graph_reason() or "replayed"
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            forward(rt, ops.x, ops.weight, ops.weight_scale, "bf16")
        torch.cuda.synchronize()
    tag = f"w{W}-{backend}-s{S}-{sched or 'auto'}"
    prof.export_chrome_trace(f"{out}/trace-{tag}.json")
    ev = [e for e in json.load(open(f"{out}/trace-{tag}.json"))["traceEvents"]
          if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ev.sort(key=lambda e: e["ts"])
    # the last replay's events: from the last graph's first event on
    t_end = max(e["ts"] + e["dur"] for e in ev)
    print(f"== {tag}: {reason}; {len(ev)} device events in 3 calls")
    last = ev[-len(ev)//3:]
    t0 = last[0]["ts"]
    for e in last:
        print(f"  {e['ts']-t0:9.1f} +{e['dur']:8.1f} s{e.get('args',{}).get('stream')} {e['cat'][:6]} {e['name'][:70]}")
    rt.close()
