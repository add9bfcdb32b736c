#!/usr/bin/env bash
# Device call of 2026-12-03 ~15:20: why the op at M = 8192, S = 8 was host-bound at 3.78 ms
# with two call streams (1.96 ms of host with one): diagnostics.host_cost with cProfile,
# one op call of 8192 rows at S = 8 and 4, call streams 2 and 1; then the compare of sdma
# at M = 8192, S = 4, 8 again with two call streams. Usage: bash session2.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for cs in 2 1; do
    for s in 8 4; do
        RADIANCE_AR_SDMA_CALL_STREAMS=$cs timeout 90 python3 -m diagnostics.host_cost \
            --backend sdma --world 4 --rows 8192 --op-slices $s --calls 30 --profile --top 30 \
            > "$out/host_cs${cs}_S$s.log" 2>&1
        echo "host cs=$cs S=$s: rc $? at ${SECONDS}s" >> "$out/summary.log"
    done
done
timeout 150 python3 tools/compare_backends.py --out-dir "$out/compare" --world 4 --m 8192 \
    --slices 4,8 --backends sdma --reps 20 --warmup 3 --no-probe --no-png > "$out/compare.log" 2>&1
echo "compare: rc $? at ${SECONDS}s" >> "$out/summary.log"
tar czf /tmp/all.tar.gz -C "$out" . && mv /tmp/all.tar.gz "$out/"
cat "$out/summary.log"; grep -v "^\[" "$out/compare.log" | sed -n 5,9p
for f in "$out"/host_cs2_S8.log "$out"/host_cs1_S8.log; do echo "== $f"; head -60 "$f"; done
