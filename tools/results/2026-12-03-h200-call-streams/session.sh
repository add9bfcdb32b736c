#!/usr/bin/env bash
# Device call of 2026-12-03 ~15:05: the dedicated-stream fix and the two call streams.
# (1) GPU tests of sdma, the op and sdma_wht6; (2) the compare tool for sdma at M = 8192
# and 16384, S = 1, 4, 8, with timelines (RADIANCE_AR_SDMA_CALL_STREAMS=2, the new
# default), (3) the same at M = 8192 with RADIANCE_AR_SDMA_CALL_STREAMS=1 (the old
# order: every call on the caller's stream). Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for f in tests/test_sdma_gpu.py tests/test_gpu_op.py tests/test_sdma_wht6_gpu.py; do
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        > "$out/t_$(basename "$f" .py).log" 2>&1
    echo "$f: $(tail -1 "$out/t_$(basename "$f" .py).log") (${SECONDS}s)" >> "$out/summary.log"
done
run() {  # name, call streams, M list, extra flags
    RADIANCE_AR_SDMA_CALL_STREAMS=$2 timeout 200 python3 tools/compare_backends.py \
        --out-dir "$out/$1" --world 4 --m "$3" --slices 1,4,8 --backends sdma --reps 20 \
        --warmup 3 --no-probe "${@:4}" > "$out/$1.log" 2>&1
    echo "$1: rc $? at ${SECONDS}s" >> "$out/summary.log"
}
run streams2 2 8192,16384 --timeline
run streams1 1 8192 --no-png
tar czf /tmp/all.tar.gz -C "$out" . && mv /tmp/all.tar.gz "$out/"
cat "$out/summary.log"
for n in streams2 streams1; do grep -v "^\[" "$out/$n.log" | sed -n 5,12p; done
grep -h "FAILED\|Error" "$out"/t_*.log | head -20
