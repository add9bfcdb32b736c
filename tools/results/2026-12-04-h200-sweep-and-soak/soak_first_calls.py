"""Throwaway: the W=4 sdma_wht6 soak with a per-call log of the graph cache's path."""
import json, sys, time, traceback
import torch
sys.path.insert(0, "tests")
import host_world_jobs as jobs
from radiance_ar import overlap
from radiance_ar.overlap import graphs as G
from radiance_ar.harness.cpu_world import CpuWorldPool


def diag_job(world, backend, calls, rows, cols, k, slices):
    log = []
    orig = G.GraphCache.call

    def call(self, key, generation, x, out_shape, sig, be, body):
        now = generation()
        ent = self._entries.get(key)
        path = "replay" if ent is not None and ent.generation == now else (
            "eager" if self._seen.get(key) != now else "capture")
        sigs = be.signals
        rec = {"t": time.monotonic(), "path": path, "gen": str(now), "epoch0": sigs.epoch}
        try:
            return orig(self, key, generation, x, out_shape, sig, be, body)
        finally:
            rec["epoch1"] = sigs.epoch
            rec["dt_ms"] = (time.monotonic() - rec["t"]) * 1e3
            log.append(rec)

    G.GraphCache.call = call
    rt = overlap.build(world, jobs._settings(backend, min(rows, 64), slices, "auto"))
    x0, w = (t.to(world.device) for t in jobs.layer_inputs(0, world.rank, rows, cols, k))
    err = None
    try:
        for i in range(calls):
            overlap.forward(rt, x0, w, None, "bf16")
            if i % 10 == 9:
                t0 = time.monotonic()
                rt.backend.check()
                log.append({"check_ms": (time.monotonic() - t0) * 1e3, "i": i})
        rt.backend.check()
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:600]}"
    G.GraphCache.call = orig
    headers = [rt.backend.signals.peer_header(p)[0] for p in range(world.size)]
    rt.close()
    return {"rank": world.rank, "err": err, "log": log, "headers": headers}


def main(out):
    res = {}
    for size, backend, slices in [(4, "sdma_wht6", "auto"), (4, "sdma_wht6", "auto"), (4, "sdma", "auto"),
                                  (4, "sdma_wht6", 2)]:
        pool = CpuWorldPool(size, collective_timeout_s=60, device="cuda", peer_memory="host")
        t0 = time.monotonic()
        try:
            r = pool.run(diag_job, backend, 120, 256, 512, 128, slices, timeout_s=120)
        except Exception as e:
            r = f"{type(e).__name__}: {str(e)[-3000:]}"
        pool.close()
        name = f"{size}-{backend}-{slices}-{len(res)}"
        res[name] = r
        ok = isinstance(r, list) and all(x["err"] is None for x in r)
        print(name, "OK" if ok else "FAIL", f"{time.monotonic()-t0:.1f}s", flush=True)
        if isinstance(r, list):
            for x in r:
                if x["err"]:
                    print("  rank", x["rank"], x["err"][:400])
                    paths = [(l.get("path"), l.get("epoch0"), l.get("epoch1"), round(l.get("dt_ms", l.get("check_ms", 0)), 1)) for l in x["log"]]
                    print("   ", paths[:40])
    json.dump(res, open(f"{out}/soak_first_calls.json", "w"), default=str)


if __name__ == "__main__":
    import soak_first_calls
    soak_first_calls.main(sys.argv[1])
