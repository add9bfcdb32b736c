#!/usr/bin/env bash
# Device call of 2026-12-03 ~16:13: what a two-shot sdma_wht6 call costs the host now
# (one active rank, slices of the op at M = 8192 S = 4 and 8), and sdma's figures again
# (the spread between two runs of the same tree). Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RADIANCE_AR_SDMA_SCHEDULE=twoshot timeout 120 python3 -m diagnostics.host_cost \
    --backend sdma_wht6 --world 4 --rows 1024,2048 --calls 50 --profile --top 40 \
    > "$out/host_cost_twoshot.log" 2>&1
echo "host_cost twoshot rc $? at ${SECONDS}s" >> "$out/summary.log"
timeout 200 python3 tools/compare_backends.py --world 4 --m 8192,16384 --slices 1,4,8 \
    --backends sdma --reps 20 --warmup 3 --no-probe --out-dir "$out/sdma_again" \
    > "$out/sdma_again.log" 2>&1
echo "sdma again rc $? at ${SECONDS}s" >> "$out/summary.log"
cat "$out/summary.log"; grep -E "host [0-9]+ us" "$out/host_cost_twoshot.log"; grep -E "^ +sdma" "$out/sdma_again.log"
