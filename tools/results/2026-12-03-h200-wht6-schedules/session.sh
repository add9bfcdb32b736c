#!/usr/bin/env bash
# Device call: sdma_wht6 one-shot against two-shot (one decode of the gathered shards),
# M = 8192 cut into S = 1, 2, 4 slices, 4 emulated ranks, 20 repeats, with the step
# timeline; the host cost of one call of each; then the sdma_wht6 GPU tests.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for s in twoshot oneshot; do
    RADIANCE_AR_SDMA_SCHEDULE=$s timeout 200 python3 tools/compare_backends.py --world 4 \
        --m 8192 --slices 1,2,4 --backends sdma_wht6 --reps 20 --warmup 3 --no-probe --timeline \
        --out-dir /tmp/sched/$s > "$out/compare_$s.log" 2>&1
    echo "compare $s rc $? at ${SECONDS}s" >> "$out/summary.log"
    RADIANCE_AR_SDMA_SCHEDULE=$s timeout 100 python3 -m diagnostics.host_cost --backend sdma_wht6 \
        --world 4 --rows 2048,4096,8192 --calls 50 > "$out/host_cost_$s.log" 2>&1
    echo "host_cost $s rc $? at ${SECONDS}s" >> "$out/summary.log"
done
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_sdma_wht6_gpu.py \
    > "$out/pytest_sdma_wht6.log" 2>&1
echo "pytest: $(tail -1 "$out/pytest_sdma_wht6.log") at ${SECONDS}s" >> "$out/summary.log"
tar czf "$out/sched.tar.gz" -C /tmp sched
cat "$out/summary.log"; grep -E "^ *sdma_wht6 |device ms per step" "$out"/compare_*.log; cat "$out"/host_cost_*.log
