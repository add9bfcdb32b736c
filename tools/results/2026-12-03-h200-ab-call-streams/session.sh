#!/usr/bin/env bash
# Device call of 2026-12-03 ~15:05: one call stream against two, the heap frozen before
# every timed function (harness.host). GPU tests of sdma (the exit no longer segfaults);
# the compare tool for sdma at M = 8192 and 16384, S = 1, 4, 8 with
# RADIANCE_AR_SDMA_CALL_STREAMS = 2 (timelines, and sdma_wht6 beside it) and = 1.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_sdma_gpu.py \
    > "$out/t_test_sdma_gpu.log" 2>&1
echo "sdma gpu tests: rc $? $(tail -1 "$out/t_test_sdma_gpu.log") (${SECONDS}s)" >> "$out/summary.log"
run() {  # name, call streams, backends, extra flags
    RADIANCE_AR_SDMA_CALL_STREAMS=$2 timeout 240 python3 tools/compare_backends.py \
        --out-dir "$out/$1" --world 4 --m 8192,16384 --slices 1,4,8 --backends "$3" \
        --reps 20 --warmup 3 --no-probe "${@:4}" > "$out/$1.log" 2>&1
    echo "$1: rc $? at ${SECONDS}s" >> "$out/summary.log"
}
run streams2 2 sdma,sdma_wht6 --timeline
run streams1 1 sdma --no-png
tar czf /tmp/all.tar.gz -C "$out" . && mv /tmp/all.tar.gz "$out/"
cat "$out/summary.log"
for n in streams2 streams1; do grep -v "^\[" "$out/$n.log" | sed -n 5,20p | grep -v "^timeline\|^  \|device ms"; done
