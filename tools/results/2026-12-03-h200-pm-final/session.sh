#!/usr/bin/env bash
# Device call of 2026-12-03 ~13:20: the final tree (by-address host path, fast launches,
# samples of 4 calls behind a first, contention over phases against the gated GEMM, the
# default stream's handle mapped to the default stream): GPU tests of sdma, the op and
# sdma_wht6; the stream check; compares; the reduce's CTA budget.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pack() { tar czf "/tmp/all.tar.gz" -C "$out" . 2>/dev/null && mv /tmp/all.tar.gz "$out/"; }
for f in tests/test_sdma_gpu.py tests/test_gpu_op.py tests/test_sdma_wht6_gpu.py; do
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        > "$out/t_$(basename "$f" .py).log" 2>&1
    echo "$f: $(tail -1 "$out/t_$(basename "$f" .py).log") (${SECONDS}s)" >> "$out/summary.log"; pack
done
# Does an event recorded on torch.cuda.ExternalStream(<the current stream's raw handle>)
# (what the step trace and CopyEngine.stream do) wait for a kernel on the current stream?
timeout 60 python3 - > "$out/stream_check.log" 2>&1 <<'PY'
import torch
from backends.interface import current_stream_handle
dev = torch.device("cuda", 0)
handle = current_stream_handle(dev)
ext = torch.cuda.ExternalStream(handle, device=dev)
a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
torch.cuda._sleep(1000)
torch.cuda.synchronize()
a.record()
torch.cuda._sleep(20_000_000)
b.record(ext)
c.record()
torch.cuda.synchronize()
# and a flag write through the CUDA Python bindings on the same handle (as the transport)
from backends.copy_engine import cuda_device_pointer, cuda_write_value
flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
torch.cuda._sleep(20_000_000)
cuda_write_value(handle, cuda_device_pointer(flag.data_ptr()), 7)
import time; time.sleep(0.002)
early = int(flag[0])
torch.cuda.synchronize()
print(f"flag write on the raw handle behind a ~10 ms sleep: read {early} 2 ms after "
      f"enqueue (7: it did not wait for the sleep), {int(flag[0])} after a sync")
print(f"raw handle {handle:#x}, torch current {torch.cuda.current_stream(dev).cuda_stream:#x}, "
      f"ExternalStream {ext.cuda_stream:#x}: event on it {a.elapsed_time(b):.3f} ms after "
      f"the start, on torch's stream {a.elapsed_time(c):.3f} ms (a sleep of ~10 ms between)")
PY
echo "stream_check: rc $? at ${SECONDS}s" >> "$out/summary.log"; cat "$out/stream_check.log" >> "$out/summary.log"
timeout 330 python3 tools/compare_backends.py --out-dir "$out/compare" --world 4 \
    --m 8192,16384 --slices 1,4,8 --backends sdma,sdma_wht6 --reps 20 --warmup 3 --no-probe \
    --timeline > "$out/compare.log" 2>&1
echo "compare: rc $? at ${SECONDS}s" >> "$out/summary.log"; pack
timeout 120 python3 tools/compare_backends.py --out-dir "$out/compare_oneshot" --world 4 \
    --m 8192 --slices 4 --backends oneshot_wht6 --reps 20 --warmup 3 --no-probe --no-png \
    > "$out/compare_oneshot.log" 2>&1
echo "compare_oneshot: rc $? at ${SECONDS}s" >> "$out/summary.log"; pack
# The reduce's CTA budget under the phase-spread contention (0 = two per SM = 264)
for ctas in 33 132 528; do
    RADIANCE_AR_SDMA_REDUCE_CTAS=$ctas timeout 60 python3 tools/compare_backends.py \
        --out-dir "$out/ctas_$ctas" --world 4 --m 8192 --slices 4 --backends sdma --reps 20 \
        --warmup 3 --no-probe --no-png > "$out/ctas_$ctas.log" 2>&1
    echo "ctas $ctas: rc $? at ${SECONDS}s" >> "$out/summary.log"; pack
done
cat "$out/summary.log"; grep -v "^\[" "$out/compare.log" | sed -n 4,22p
grep -v "^\[" "$out/compare_oneshot.log" | sed -n 5,9p
for ctas in 33 132 528; do grep "sdma " "$out/ctas_$ctas.log" | head -1; done
