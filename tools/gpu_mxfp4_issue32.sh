#!/usr/bin/env bash
# Issue 32 on one H200 in about 3 minutes: the fp8-MMA MXFP4 W4A8 GEMM tuned and measured,
# the producer's routes benched, the GPU tests of the MXFP4 files.
# Usage (on a GPU machine, repository root): tools/gpu_mxfp4_issue32.sh OUT_DIR
# Writes into OUT_DIR: tune_mxfp4_fp8.{log,json} (prepare bits and time; every candidate
# config's error and TFLOP/s per shape and M beside torch's bf16 and fp8 rowwise GEMMs; the
# CONFIGS table to paste), bench_mxfp4.{log,json} (the producer's routes at 8192 x 5120 x
# 4352), summary.log and pytest_full.log (tools/gpu_session.sh). Exits 1 if any step failed.
set -uo pipefail
out=${1:?usage: tools/gpu_mxfp4_issue32.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
failed=()
timeout 120 python3 tools/tune_mxfp4_fp8.py --json "$out/tune_mxfp4_fp8.json" \
    > "$out/tune_mxfp4_fp8.log" 2>&1 || failed+=("tune_mxfp4_fp8 rc $?")
timeout 45 python3 tools/bench_mxfp4.py --json "$out/bench_mxfp4.json" \
    > "$out/bench_mxfp4.log" 2>&1 || failed+=("bench_mxfp4 rc $?")
GPU_TESTS="tests/test_mxfp4_fp8_gemm.py tests/test_mxfp4_routes.py tests/test_mxfp4.py \
tests/test_producers.py" DEADLINE_S=$((175 - SECONDS)) tools/gpu_session.sh "$out" > /dev/null
while read -r line; do
    case "$line" in
        tests/*": rc 0: "*passed*) case "$line" in *failed*|*error*) failed+=("$line");; esac;;
        tests/*) failed+=("$line");;
    esac
done < "$out/summary.log"
echo "===== bench_mxfp4 (the producer's routes)"; tail -n 20 "$out/bench_mxfp4.log"
echo "===== tune_mxfp4_fp8 (the Triton fp8 GEMM)"; tail -n 45 "$out/tune_mxfp4_fp8.log"
echo "===== GPU tests"; grep '^tests/' "$out/summary.log"
echo "===== ${SECONDS}s; failed: ${#failed[@]}"
for f in "${failed[@]}"; do echo "FAILED: $f"; done
[ ${#failed[@]} -eq 0 ]
