#!/usr/bin/env bash
# Device call: the cached Triton launches. Host time per step kind, one call's host cost
# (sdma, sdma_wht6 both schedules), the op at M = 8192 (sdma S = 4, 8; sdma_wht6 S = 1, 4
# each schedule), then the GPU tests of the codec, sdma and sdma_wht6.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python3 -m diagnostics.host_steps --calls 2000 > "$out/host_steps.log" 2>&1
{
timeout 60 python3 -m diagnostics.host_cost --backend sdma --world 4 --rows 1024,2048 --calls 100
for s in oneshot twoshot; do
    RADIANCE_AR_SDMA_SCHEDULE=$s timeout 60 python3 -m diagnostics.host_cost --backend sdma_wht6 \
        --world 4 --rows 2048,8192 --calls 50
done
} > "$out/host_cost.log" 2>&1
timeout 120 python3 tools/compare_backends.py --world 4 --m 8192 --slices 4,8 --backends sdma \
    --reps 20 --warmup 3 --no-probe --out-dir /tmp/lc/sdma > "$out/compare_sdma.log" 2>&1
for s in oneshot twoshot; do
    RADIANCE_AR_SDMA_SCHEDULE=$s timeout 120 python3 tools/compare_backends.py --world 4 --m 8192 \
        --slices 1,4 --backends sdma_wht6 --reps 20 --warmup 3 --no-probe \
        --out-dir /tmp/lc/wht6_$s > "$out/compare_wht6_$s.log" 2>&1
done
echo "compares done at ${SECONDS}s" > "$out/summary.log"
for f in tests/test_wht6.py tests/test_sdma_gpu.py tests/test_sdma_wht6_gpu.py tests/test_gpu_op.py; do
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" >> "$out/pytest.log" 2>&1
    echo "$f: $(tail -1 "$out/pytest.log") (${SECONDS}s)" >> "$out/summary.log"
done
tar czf "$out/lc.tar.gz" -C /tmp lc
cat "$out/summary.log" "$out/host_steps.log" "$out/host_cost.log"; grep -hE "^ *sdma" "$out"/compare_*.log
