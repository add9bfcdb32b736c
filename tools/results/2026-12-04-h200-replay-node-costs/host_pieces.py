"""Throwaway (session 6): where a replayed op call's host time goes, piece by piece, each
piece timed alone over many calls (no profiler): W = 2 / 4, sdma / sdma_wht6, S = 4 / 8."""
import json, os, statistics, sys, time
sys.path.insert(0, "tools")
import torch
from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward, check_inputs
from radiance_ar.overlap.plan import CallPlan
from radiance_ar.overlap import producers
from radiance_ar.call_contract import CallSignature
from radiance_ar.streams import current_stream_handle
import producer_inputs
from world_measure import Case, shard

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)


def us(fn, n=300, sync=False):
    ts = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(ts), 2)


recs = []
for W, backend, S in [(2, "sdma_wht6", 4), (2, "sdma_wht6", 8), (4, "sdma_wht6", 4), (4, "sdma_wht6", 8),
                      (2, "sdma", 4), (4, "sdma", 8)]:
    case = Case(backend, 8192, 5120, 4352, S, 20, 3)
    world = emulated_worlds(W, dev)[0]
    rt = overlap.build(world, OverlapSettings(True, backend, 1, S, BackendSettings.from_env()))
    ops = producer_inputs.operands("bf16", *shard(case, 0, dev))
    x, w = ops.x, ops.weight
    be = rt.backend
    be.ensure_capacity(8192, 5120, torch.bfloat16); be.fill_passive_peers()
    call = lambda: forward(rt, x, w, None, "bf16")
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    g = rt.graphs(); entry = next(iter(g._entries.values()))
    prod = producers.get("bf16")
    stream = current_stream_handle(dev)
    rec = dict(W=W, backend=backend, S=S)
    rec["call_sync"] = us(call, 100, sync=True)
    rec["replay_sync"] = us(entry.graph.replay, 100, sync=True)
    rec["x_copy"] = us(lambda: entry.x.copy_(x), 200, sync=True)
    rec["empty"] = us(lambda: torch.empty((8192, 5120), dtype=x.dtype, device=dev))
    o = torch.empty((8192, 5120), dtype=x.dtype, device=dev)
    rec["out_copy"] = us(lambda: o.copy_(entry.out), 200, sync=True)
    rec["check_inputs"] = us(lambda: check_inputs(x, w, None, "bf16"))
    rec["for_call"] = us(lambda: CallPlan.for_call(rt, prod, x, w))
    rec["capturing_query"] = us(torch.cuda.is_current_stream_capturing)
    rec["graphs()"] = us(rt.graphs)
    rec["signature"] = us(lambda: CallSignature(8192, 5120, x.dtype, "flags", 8192, 4352, 0, be.tuning_word))
    rec["stream_handle"] = us(lambda: current_stream_handle(dev))
    def one_call():
        with rt.one_call_at_a_time():
            pass
    rec["one_call_at_a_time"] = us(one_call)
    sig = CallSignature(8192, 5120, x.dtype, "flags", 8192, 4352, 0, be.tuning_word)
    def replay_ctx():
        with be.replay_call(sig, entry.round, stream):
            pass
    rec["replay_call_ctx"] = us(replay_ctx, 200, sync=True)
    ev = torch.cuda.Event()
    rec["event_record"] = us(lambda: ev.record())
    rec["generation"] = us(lambda: (rt.scratch.growths, be.generation))
    rec["nodes_note"] = "passive peers"
    print(json.dumps(rec), flush=True)
    recs.append(rec)
    rt.close()
    json.dump(recs, open(f"{OUT}/s6_host.json", "w"), indent=1)
