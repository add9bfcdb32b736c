#!/usr/bin/env bash
# Device call: host time per step kind, and one call's host cost for sdma and sdma_wht6.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 120 python3 -m diagnostics.host_steps --calls 2000 --json "$out/host_steps.json" \
    > "$out/host_steps.log" 2>&1
timeout 100 python3 -m diagnostics.host_cost --backend sdma --world 4 --rows 1024,2048 \
    --calls 100 > "$out/host_cost_sdma.log" 2>&1
RADIANCE_AR_SDMA_SCHEDULE=oneshot timeout 100 python3 -m diagnostics.host_cost --backend sdma \
    --world 4 --rows 1024,2048 --calls 100 > "$out/host_cost_sdma_oneshot.log" 2>&1
cat "$out"/*.log
