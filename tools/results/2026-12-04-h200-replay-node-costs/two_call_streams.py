"""Throwaway (session 6): replayed op calls with the transport's two call streams kept
inside the capture (CallStreams.caller_only patched to a no-op) against one stream."""
import contextlib, json, os, statistics, sys
sys.path.insert(0, "tools")
import torch
from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.transport.call_streams import CallStreams
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
import gpu_timing, producer_inputs
from world_measure import Case, shard

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
orig = CallStreams.caller_only
rows = []
for W in (2, 4):
    for backend in ("sdma_wht6", "sdma"):
        for S in (1, 2, 4, 8):
            for mode in ("one", "two"):
                if S == 1 and mode == "two":
                    continue
                CallStreams.caller_only = orig if mode == "one" else (lambda self: contextlib.nullcontext())
                case = Case(backend, 8192, 5120, 4352, S, 20, 3)
                world = emulated_worlds(W, dev)[0]
                rt = overlap.build(world, OverlapSettings(True, backend, 1, S, BackendSettings.from_env()))
                ops = producer_inputs.operands("bf16", *shard(case, 0, dev))
                rt.backend.ensure_capacity(8192, 5120, torch.bfloat16)
                rt.backend.fill_passive_peers()
                fn = lambda i: forward(rt, ops.x, ops.weight, ops.weight_scale, "bf16")
                host = []
                s = gpu_timing.event_times(fn, 20, 3, host_ms=host)
                rec = dict(W=W, backend=backend, S=S, streams=mode, ms=statistics.median(s),
                           spread=(max(s) - min(s)) / 2, host_ms=statistics.median(host),
                           graphs=rt.graph_reason() or "replayed", captures=rt._graphs.captures if rt._graphs else 0)
                print(json.dumps(rec), flush=True)
                rows.append(rec)
                rt.close()
                json.dump(rows, open(f"{OUT}/s6_streams.json", "w"), indent=1)
