"""Throwaway (session 6): cuBLASLt with an SM carve-out around the op's GEMM slices, sdma_wht6,
W = 2 and 4, S = 1, 2, 4 (replayed, passive peers); every arm with cublas and cublaslt."""
import json, os, statistics, sys
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
rows = []
for W in (2, 4):
    for S in (1, 2, 4):
        for lib, carve in (("cublas", 0), ("cublaslt", 0), ("cublaslt", 8), ("cublaslt", 16), ("cublaslt", 24)):
            torch.backends.cuda.preferred_blas_library(lib)
            torch._C._set_sm_carveout_experimental(carve)
            backend = "sdma_wht6"
            case = Case(backend, 8192, 5120, 4352, S, 20, 3)
            world = emulated_worlds(W, dev)[0]
            rt = overlap.build(world, OverlapSettings(True, backend, 1, S, BackendSettings.from_env()))
            ops = producer_inputs.operands("bf16", *shard(case, 0, dev))
            rt.backend.ensure_capacity(8192, 5120, torch.bfloat16)
            rt.backend.fill_passive_peers()
            fn = lambda i: forward(rt, ops.x, ops.weight, ops.weight_scale, "bf16")
            s = gpu_timing.event_times(fn, 20, 3)
            y = torch.empty(8192, 5120, dtype=torch.bfloat16, device=dev)
            g = gpu_timing.event_times(lambda i: torch.mm(ops.x, ops.weight.t(), out=y), 20, 3)
            rec = dict(W=W, S=S, lib=lib, carve=carve, ms=statistics.median(s), spread=(max(s) - min(s)) / 2,
                       gemm_ms=statistics.median(g))
            print(json.dumps(rec), flush=True)
            rows.append(rec)
            rt.close()
            json.dump(rows, open(f"{OUT}/s6_carve.json", "w"), indent=1)
