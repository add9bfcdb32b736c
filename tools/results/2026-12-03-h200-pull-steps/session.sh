#!/usr/bin/env bash
# Device call of 2026-12-03 ~14:40: (1) the GPU tests of sdma and the op, which check
# CopyTransport.call_stream (a default-stream caller) on the GPU for the first time;
# (2) diagnostics.pull_steps: the device time of a two-shot slice's pulls in each order;
# (3) the compare tool for sdma at M = 8192, S = 1, 4, 8 with timelines (the baseline of
# the changes the pull orders suggest). Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for f in tests/test_sdma_gpu.py tests/test_gpu_op.py; do
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        > "$out/t_$(basename "$f" .py).log" 2>&1
    echo "$f: $(tail -1 "$out/t_$(basename "$f" .py).log") (${SECONDS}s)" >> "$out/summary.log"
done
timeout 60 python3 -m diagnostics.pull_steps --shard-mib 2.5,5,20 --json "$out/pull_steps.json" \
    > "$out/pull_steps.log" 2>&1
echo "pull_steps: rc $? at ${SECONDS}s" >> "$out/summary.log"
timeout 120 python3 tools/compare_backends.py --out-dir "$out/compare" --world 4 --m 8192 \
    --slices 1,4,8 --backends sdma --reps 20 --warmup 3 --no-probe --timeline \
    > "$out/compare.log" 2>&1
echo "compare: rc $? at ${SECONDS}s" >> "$out/summary.log"
tar czf /tmp/all.tar.gz -C "$out" . && mv /tmp/all.tar.gz "$out/"
cat "$out/summary.log" "$out/pull_steps.log"; grep -v "^\[" "$out/compare.log" | sed -n 5,10p
grep -h "FAILED\|Error" "$out"/t_*.log | head -20
