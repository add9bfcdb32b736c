#!/usr/bin/env bash
# Issue 30 on one GPU (<= 3 minutes on an H200): a tune run at two M values (W = 2 emulated,
# N = 5120, sdma / sdma_wht6 / oneshot_wht6 at S = 1 and 4) writes a tuning file, then the op
# under RADIANCE_AR_BACKEND=auto is checked on every rank against float64 and timed against
# the best tuned row of each accuracy class (tests/test_auto_gpu.py).
# Usage: tools/gpu_check_auto.sh OUT_DIR. Writes OUT_DIR/summary.log, test_auto_gpu.log,
# tune.log, tuning-w2.json, auto.json; prints the summary last; rc: pytest's.
set -uo pipefail
out=${1:?usage: tools/gpu_check_auto.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
base=/tmp/gpu_check_auto
rm -rf "$base"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/summary.log" 2>&1
timeout 170 python3 -m pytest -q -s -m gpu -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=60 --basetemp="$base" tests/test_auto_gpu.py \
    > "$out/test_auto_gpu.log" 2>&1
rc=$?
for f in tune.log tuning-w2.json auto.json; do
    find "$base" -name "$f" -exec cp {} "$out/$f" \; 2>/dev/null
done
{
    echo "pytest tests/test_auto_gpu.py: rc $rc after ${SECONDS}s: $(tail -1 "$out/test_auto_gpu.log")"
    echo "--- tune run (tools/tune.py; its cases' mean time sizes the full tune):"
    grep -v '^\[' "$out/tune.log" 2>/dev/null | tail -12
    echo "--- the op under auto against the tuned rows:"
    grep -A6 '^accuracy   M' "$out/test_auto_gpu.log"
} >> "$out/summary.log"
cat "$out/summary.log"
exit $rc
