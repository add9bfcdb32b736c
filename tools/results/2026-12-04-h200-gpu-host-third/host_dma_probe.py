"""torchrun --nproc-per-node 2, RADIANCE_AR_PEER_MEMORY=host: rank 0 times copies against
the gpu-host world's registered shared memory and the emulated world's pinned memory,
one direction and both at once; rank 1 waits at a barrier."""
import statistics, sys, torch, torch.distributed as dist
sys.path.insert(0, "tools")
from compare_backends import start_torchrun_world
from radiance_ar.transport.world import emulated_worlds
from radiance_ar.transport.copy_engine import CopyEngine

NB = 64 << 20
world, dev, shared = start_torchrun_world()
host = world.memory.allocate("dma_probe", NB)
emu = emulated_worlds(2, dev)[0]
ebuf = emu.memory.allocate("dma_probe", NB)
dist.barrier()
if world.rank == 0:
    eng = CopyEngine(dev)
    d1 = torch.empty(NB, dtype=torch.uint8, device=dev); d2 = torch.empty_like(d1)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    def t(label, pairs):
        ts = []
        for i in range(23):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); s1.wait_event(a); s2.wait_event(a)
            for (dst, src), s in zip(pairs, (s1, s2)):
                eng.copy(dst, src, s.cuda_stream)
            e1 = torch.cuda.Event(); e1.record(s1); e2 = torch.cuda.Event(); e2.record(s2)
            torch.cuda.current_stream().wait_event(e1); torch.cuda.current_stream().wait_event(e2)
            b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        ms = statistics.median(ts[3:])
        print(f"{label:60s} {sum(d.numel() for d, _ in pairs) / ms / 1e6:6.1f} GB/s total ({ms:.3f} ms)", flush=True)
    for name, buf in (("host", host), ("emulated", ebuf)):
        for p in (0, 1):
            t(f"{name}: H2D from peer({p})", [(d1, buf.peer(p))])
            t(f"{name}: D2H into peer({p})", [(buf.peer(p), d1)])
        t(f"{name}: H2D peer(1) + D2H peer(0) at once", [(d1, buf.peer(1)), (buf.peer(0), d2)])
        half = NB // 2
        t(f"{name}: H2D peer(1)[:half] + H2D peer(1)[half:] at once",
          [(d1[:half], buf.peer(1)[:half]), (d2[:half], buf.peer(1)[half:])])
    torch.cuda.synchronize()
dist.barrier()
dist.destroy_process_group()
