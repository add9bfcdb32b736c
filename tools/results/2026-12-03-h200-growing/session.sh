#!/usr/bin/env bash
# Device call of 2026-12-03 ~16:25: uniform against growing slices for sdma (4 emulated
# ranks, M = 8192 and 16384, S = 3, 4, 5), a timeline of growing S = 4 at M = 8192, and the
# sdma GPU tests (the op now also runs growing plans). Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python3 tools/compare_backends.py --world 4 --m 8192,16384 --slices 3,4,5 \
    --plans uniform,growing --backends sdma --reps 20 --warmup 3 --no-probe \
    --out-dir "$out/plans" > "$out/plans.log" 2>&1
echo "plans rc $? at ${SECONDS}s" >> "$out/summary.log"
timeout 100 python3 tools/compare_backends.py --world 4 --m 8192 --slices 4,8 \
    --plans growing --backends sdma --reps 20 --warmup 3 --no-probe --timeline \
    --out-dir "$out/timeline" > "$out/timeline.log" 2>&1
echo "timeline rc $? at ${SECONDS}s" >> "$out/summary.log"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sdma_gpu.py \
    > "$out/t_test_sdma_gpu.log" 2>&1
echo "sdma gpu tests rc $?: $(tail -1 "$out/t_test_sdma_gpu.log") at ${SECONDS}s" >> "$out/summary.log"
cat "$out/summary.log"; grep -E "^ +sdma" "$out/plans.log" "$out/timeline.log"
