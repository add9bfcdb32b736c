"""Throwaway: (1) GEMM SM carveout vs the replayed op; (2) wht6 one-shot vs two-shot per
call size on the replayed path, W=4; (3) cProfile of replayed calls' host side."""
import cProfile, io, json, os, pstats, statistics, sys
sys.path.insert(0, "tools")
import torch
from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
import gpu_timing, producer_inputs
from world_measure import Case, shard

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
rows_out = []

def timed(W, backend, M, S, sched=None, carve=0, reps=20, prof=False):
    if sched: os.environ["RADIANCE_AR_SDMA_SCHEDULE"] = sched
    else: os.environ.pop("RADIANCE_AR_SDMA_SCHEDULE", None)
    torch._C._set_sm_carveout_experimental(carve)
    case = Case(backend, M, 5120, 4352, S, reps, 3)
    world = emulated_worlds(W, dev)[0]
    rt = overlap.build(world, OverlapSettings(True, backend, 1, S, BackendSettings.from_env()))
    ops = producer_inputs.operands("bf16", *shard(case, 0, dev))
    rt.backend.ensure_capacity(M, 5120, torch.bfloat16)
    rt.backend.fill_passive_peers()
    fn = lambda i: forward(rt, ops.x, ops.weight, ops.weight_scale, "bf16")
    host = []
    s = gpu_timing.event_times(fn, reps, 3, host_ms=host)
    y = torch.empty(M, 5120, dtype=torch.bfloat16, device=dev)
    g = gpu_timing.event_times(lambda i: torch.mm(ops.x, ops.weight.t(), out=y), reps, 3)
    rec = dict(W=W, backend=backend, M=M, S=S, sched=sched or "auto", carveout=carve,
               ms=statistics.median(s), spread=(max(s)-min(s))/2, host_ms=statistics.median(host),
               gemm_ms=statistics.median(g), graphs=rt.graph_reason() or "replayed")
    if prof:
        pr = cProfile.Profile(); pr.enable()
        for i in range(200): fn(i)
        pr.disable(); torch.cuda.synchronize()
        sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25)
        open(f"{OUT}/cprofile-{backend}-w{W}-s{S}.txt", "w").write(sio.getvalue())
    rt.close()
    torch._C._set_sm_carveout_experimental(0)
    print(json.dumps(rec), flush=True)
    rows_out.append(rec)

part = sys.argv[1]
if part == "carve":
    for W, backend, S, sched in [(2, "sdma_wht6", 4, None), (4, "sdma_wht6", 4, "twoshot"),
                                 (2, "sdma", 4, None), (2, "sdma_wht6", 1, None)]:
        for carve in (0, 8, 16, 32):
            timed(W, backend, 8192, S, sched, carve)
elif part == "sched":
    for M in (1024, 2048, 4096, 8192):
        for sched in ("oneshot", "twoshot"):
            timed(4, "sdma_wht6", M, 1, sched)
    for S in (2, 4, 8):
        timed(4, "sdma_wht6", 8192, S, "twoshot")
        timed(4, "sdma_wht6", 16384, S, "twoshot")
elif part == "prof":
    timed(4, "sdma", 8192, 8, None, prof=True)
    timed(2, "sdma_wht6", 8192, 4, None, prof=True)
json.dump(rows_out, open(f"{OUT}/exp2-{part}.json", "w"), indent=1)
