"""compare_backends with every stream radiance-ar creates itself (dedicated_stream: the
graph capture stream, the call streams, the publish lane; the AR's codec kernels run
there, captured graphs keep their nodes' priority) at the device's greatest priority;
the GEMM's side stream (torch's pool) stays at the default."""
import runpy, sys
sys.path.insert(0, "tools")
from cuda.bindings import runtime as rt
err, least, greatest = rt.cudaDeviceGetStreamPriorityRange()
print(f"stream priorities: least {least}, greatest {greatest}", flush=True)
rt.cudaStreamCreateWithFlags = lambda flags: rt.cudaStreamCreateWithPriority(flags, greatest)
sys.argv = ["tools/compare_backends.py"] + sys.argv[1:]
runpy.run_path("tools/compare_backends.py", run_name="__main__")
