#!/usr/bin/env bash
# Device call of 2026-12-03 ~13:30: the default stream's calls on the transport's own
# stream (CopyTransport.call_stream): GPU tests of sdma (incl. a rank on the default stream
# whose input is written behind a sleep) and the op; then the compare of sdma
# at M = 8192 (its timing runs on the default stream, so now on the own stream).
# Usage: bash session2.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for f in tests/test_sdma_gpu.py tests/test_gpu_op.py; do
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        > "$out/t2_$(basename "$f" .py).log" 2>&1
    echo "$f: $(tail -1 "$out/t2_$(basename "$f" .py).log") (${SECONDS}s)" >> "$out/summary2.log"
done
timeout 70 python3 tools/compare_backends.py --out-dir "$out/compare2" --world 4 --m 8192 \
    --slices 1,4,8 --backends sdma --reps 20 --warmup 3 --no-probe --no-png \
    > "$out/compare2.log" 2>&1
echo "compare2: rc $? at ${SECONDS}s" >> "$out/summary2.log"
tar czf /tmp/all2.tar.gz -C "$out" . && mv /tmp/all2.tar.gz "$out/"
cat "$out/summary2.log"; grep -v "^\[" "$out/compare2.log" | sed -n 5,12p
grep -h "FAILED\|Error" "$out"/t2_*.log | head -20
