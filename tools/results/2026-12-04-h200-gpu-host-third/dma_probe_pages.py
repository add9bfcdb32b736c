"""Device probe: copy-engine rate between a device buffer and host memory of several kinds."""
import ctypes, mmap, os, statistics, sys, tempfile
import torch
from cuda.bindings import runtime as rt

NB = 64 << 20
dev = torch.device("cuda", 0)
d = torch.empty(NB, dtype=torch.uint8, device=dev)
s = torch.cuda.Stream()

def rate(host_ptr, label, reps=20):
    out = []
    for direction in ("H2D", "D2H"):
        ts = []
        for _ in range(reps + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record()
                if direction == "H2D":
                    err, = rt.cudaMemcpyAsync(d.data_ptr(), host_ptr, NB, rt.cudaMemcpyKind.cudaMemcpyDefault, s.cuda_stream)
                else:
                    err, = rt.cudaMemcpyAsync(host_ptr, d.data_ptr(), NB, rt.cudaMemcpyKind.cudaMemcpyDefault, s.cuda_stream)
                b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        med = statistics.median(ts[3:])
        out.append(f"{direction} {NB / med / 1e6:6.1f} GB/s")
    print(f"{label:55s} " + "  ".join(out), flush=True)

p = torch.empty(NB, dtype=torch.uint8, pin_memory=True)
rate(p.data_ptr(), "cudaHostAlloc (torch pin_memory)")
print("THP shmem_enabled:", open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip(),
      "| enabled:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
      "| HugePages_Total:", [l for l in open("/proc/meminfo") if "HugePages_Total" in l][0].split()[1], flush=True)

def shm_map(advise=None, populate=False):
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.ftruncate(fd, NB)
    m = mmap.mmap(fd, NB, mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0), mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd); os.unlink(path)
    if advise is not None:
        m.madvise(advise)
    m.write(b"\1" * NB)
    return m

def reg(m, flags, label):
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    err, = rt.cudaHostRegister(addr, NB, flags)
    if int(err) != 0:
        print(label, "register failed", err); return
    rate(addr, label)
    rt.cudaHostUnregister(addr)

for flags, fl in ((3, "portable|mapped"), (0, "default"), (1, "portable")):
    m = shm_map(); reg(m, flags, f"/dev/shm file + cudaHostRegister {fl}")
m = shm_map(mmap.MADV_HUGEPAGE); reg(m, 3, "/dev/shm file + MADV_HUGEPAGE + register")
a = mmap.mmap(-1, NB, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS); a.madvise(mmap.MADV_HUGEPAGE); a.write(b"\1" * NB)
reg(a, 3, "anonymous shared + MADV_HUGEPAGE + register")
b = mmap.mmap(-1, NB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS); b.madvise(mmap.MADV_HUGEPAGE); b.write(b"\1" * NB)
reg(b, 3, "anonymous private + MADV_HUGEPAGE + register")
try:
    fd = os.memfd_create("probe", os.MFD_HUGETLB)
    os.ftruncate(fd, NB); h = mmap.mmap(fd, NB); h.write(b"\1" * NB); reg(h, 3, "memfd MFD_HUGETLB + register")
except OSError as e:
    print("memfd MFD_HUGETLB:", e)

# Hypothesis 2: another process's context with queued work (a stream wait on a flag, as a
# parked peer has) makes the GPU time-slice between contexts and halves this one's copies.
import subprocess, time
child_src = r'''
import ctypes, mmap, os, sys, torch
from cuda.bindings import runtime as rt, driver as dr
path = sys.argv[1]
fd = os.open(path, os.O_RDWR); m = mmap.mmap(fd, 4096); os.close(fd)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
torch.cuda.init(); s = torch.cuda.Stream()
err, = rt.cudaHostRegister(addr, 4096, 3); assert int(err) == 0, err
err, dptr = rt.cudaHostGetDevicePointer(addr, 0); assert int(err) == 0, err
err, = dr.cuStreamWaitValue32(dr.CUstream(s.cuda_stream), dr.CUdeviceptr(dptr), 1, 0); assert int(err) == 0, err
print("waiting", flush=True)
s.synchronize(); print("released", flush=True)
'''
for n_children in (1, 3):
    paths, kids = [], []
    for i in range(n_children):
        fd, path = tempfile.mkstemp(dir="/dev/shm"); os.ftruncate(fd, 4096); os.close(fd); paths.append(path)
        kids.append(subprocess.Popen([sys.executable, "-c", child_src, path], stdout=subprocess.PIPE, text=True))
    ok = all(k.stdout.readline().strip() == "waiting" for k in kids)
    time.sleep(0.5)
    m = shm_map(); reg(m, 3, f"registered shm, {n_children} other process(es) parked on a wait (ok={ok})")
    rate(p.data_ptr(), f"cudaHostAlloc, {n_children} other process(es) parked")
    for path in paths:
        fd = os.open(path, os.O_RDWR); mm = mmap.mmap(fd, 4096); os.close(fd); mm[0:4] = (1).to_bytes(4, "little"); mm.close()
    for k in kids:
        try:
            print("child:", k.communicate(timeout=20)[0].strip())
        except subprocess.TimeoutExpired:
            k.kill(); print("child did not release")
    for path in paths:
        os.unlink(path)
