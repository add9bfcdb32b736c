#!/usr/bin/env bash
# Device call: where sdma_wht6's two-shot schedule spends a slice inside the op (step
# timeline, S = 4, M = 8192, 4 emulated ranks) and what one call costs the host, both
# schedules side by side. Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for s in twoshot oneshot; do
    RADIANCE_AR_SDMA_SCHEDULE=$s timeout 150 python3 tools/compare_backends.py --world 4 \
        --m 8192 --slices 4 --backends sdma_wht6 --reps 10 --warmup 3 --no-probe --timeline \
        --out-dir /tmp/steps/$s > "$out/compare_$s.log" 2>&1
    echo "compare $s rc $? at ${SECONDS}s" >> "$out/summary.log"
    RADIANCE_AR_SDMA_SCHEDULE=$s timeout 100 python3 -m diagnostics.host_cost --backend sdma_wht6 \
        --world 4 --rows 2048 --calls 50 --profile --top 30 > "$out/host_cost_$s.log" 2>&1
    echo "host_cost $s rc $? at ${SECONDS}s" >> "$out/summary.log"
done
tar czf "$out/steps.tar.gz" -C /tmp steps
cat "$out/summary.log"; grep -A8 "timeline sdma_wht6" "$out"/compare_*.log; head -1 "$out"/host_cost_*.log
