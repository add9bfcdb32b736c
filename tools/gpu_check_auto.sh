#!/usr/bin/env bash
# Issue 30 on one GPU (<= 3 minutes on an H200), tests/test_auto_gpu.py:
# - a tune run at two M values (W = 2 emulated, N = 5120, sdma / sdma_wht6 / oneshot_wht6 at
#   S = 1 and 4) writes a tuning file;
# - the op under RADIANCE_AR_BACKEND=auto, every emulated rank prepared first (rule 1), two
#   calls a shape, checked on every rank against float64: W = 2 from that file, W = 4 from the
#   shipped table (no RADIANCE_AR_TUNING), both accuracy classes;
# - an unprepared emulated call raises instead of parking;
# - the op under auto runs the best tuned row of each class; its time beside that row's
#   (a ratio reported here, not asserted by the test: speed is this benchmark's).
# Usage: tools/gpu_check_auto.sh OUT_DIR. Writes OUT_DIR/summary.log, test_auto_gpu.log,
# tune.log, tuning-w2.json, auto.json; prints the summary last; rc: pytest's.
set -uo pipefail
out=${1:?usage: tools/gpu_check_auto.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
base=/tmp/gpu_check_auto
rm -rf "$base"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/summary.log" 2>&1
timeout 170 python3 -m pytest -v -s -m gpu -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=60 --basetemp="$base" tests/test_auto_gpu.py \
    > "$out/test_auto_gpu.log" 2>&1
rc=$?
if [ $rc -eq 0 ] && ! grep -q ' passed' "$out/test_auto_gpu.log"; then
    rc=1  # every test skipped: nothing was checked on the GPU
fi
for f in tune.log tuning-w2.json auto.json; do
    find "$base" -name "$f" -exec cp {} "$out/$f" \; 2>/dev/null
done
{
    echo "pytest tests/test_auto_gpu.py: rc $rc after ${SECONDS}s: $(tail -1 "$out/test_auto_gpu.log")"
    grep -E '(PASSED|FAILED|ERROR|SKIPPED)' "$out/test_auto_gpu.log" | grep '::' | cut -c1-150
    echo "--- tune run (tools/tune.py; its cases' mean time sizes the full tune):"
    grep -v '^\[' "$out/tune.log" 2>/dev/null | grep '^# ' | head -2
    if [ -f "$out/tuning-w2.json" ]; then
        echo "--- what auto chooses from it (tools/tune.py --summary FILE --markdown):"
        python3 tools/tune.py --summary "$out/tuning-w2.json" --markdown | tail -n +3
    fi
    echo "--- the op under auto against the tuned rows:"
    grep -A6 '^accuracy   M' "$out/test_auto_gpu.log"
} >> "$out/summary.log"
cat "$out/summary.log"
exit $rc
