#!/usr/bin/env bash
# Device call: where the host time of one op call goes (cProfile), and a baseline
# compare with a timeline. Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m diagnostics.host_cost --backend sdma --world 4 --rows 8192 \
    --op-slices 4 --calls 30 --profile --top 60 > "$out/host_cost_op_s4.log" 2>&1
for s in 1 8; do
    timeout 100 python3 -m diagnostics.host_cost --backend sdma --world 4 --rows 8192 \
        --op-slices $s --calls 30 > "$out/host_cost_op_s$s.log" 2>&1
done
timeout 100 python3 -m diagnostics.host_cost --backend sdma --world 4 --rows 1024,2048 \
    --calls 100 > "$out/host_cost_ar.log" 2>&1
timeout 200 python3 tools/compare_backends.py --out-dir "$out/compare" --world 4 --m 8192 \
    --slices 4,8 --backends sdma --reps 20 --warmup 3 --no-probe --timeline \
    > "$out/compare.log" 2>&1
tail -n 30 "$out"/host_cost_op_s1.log "$out"/host_cost_op_s8.log "$out"/host_cost_ar.log
grep -v "^\[" "$out/compare.log"
