#!/usr/bin/env bash
# Issue 32 on one H200 in about 3 minutes: the GPU tests of the new MXFP4 kernels and
# routes, the fp8-MMA MXFP4 W4A8 GEMM tuned and measured, the producer's routes benched,
# the older MXFP4 GPU tests, and (time allowing) the routes' sweep over prefill shapes.
# Usage (on a GPU machine, repository root): tools/gpu_mxfp4_issue32.sh OUT_DIR
# Writes into OUT_DIR: tune_mxfp4_fp8.{log,json} (prepare bits and time; every candidate
# config's error and TFLOP/s per shape and M beside torch's bf16 and fp8 rowwise GEMMs; the
# CONFIGS table to paste), bench_mxfp4.{log,json} (the producer's routes at 8192 x 5120 x
# 4352), sweep.{log,json} (if run), new_tests/ and old_tests/ (tools/gpu_session.sh's
# summary.log and pytest_full.log). Exits 1 if any step failed.
set -uo pipefail
out=${1:?usage: tools/gpu_mxfp4_issue32.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
failed=()
tests() {  # tools/gpu_session.sh over test files into $out/$1, within $2 seconds
    GPU_TESTS="$3" DEADLINE_S=$2 tools/gpu_session.sh "$out/$1" > /dev/null
    while read -r line; do
        case "$line" in
            tests/*": rc 0: "*passed*) case "$line" in *failed*|*error*) failed+=("$line");; esac;;
            tests/*) failed+=("$line");;
        esac
    done < "$out/$1/summary.log"
}
tests new_tests 60 "tests/test_mxfp4_fp8_gemm.py tests/test_mxfp4_routes.py"
timeout 120 python3 tools/tune_mxfp4_fp8.py --json "$out/tune_mxfp4_fp8.json" \
    > "$out/tune_mxfp4_fp8.log" 2>&1 || failed+=("tune_mxfp4_fp8 rc $?")
timeout 45 python3 tools/bench_mxfp4.py --config 256,128,64,8,1,1,8,3,bf16 --reps 20 \
    --json "$out/bench_mxfp4.json" > "$out/bench_mxfp4.log" 2>&1 || failed+=("bench_mxfp4 rc $?")
tests old_tests $((200 - SECONDS)) "tests/test_mxfp4.py tests/test_producers.py"
if [ "$SECONDS" -lt 150 ]; then
    timeout 60 python3 tools/bench_mxfp4.py --sweep --sweep-rows 256,2048,16384 --reps 5 \
        --warmup 2 --json "$out/sweep.json" > "$out/sweep.log" 2>&1 || failed+=("sweep rc $?")
else
    echo "sweep: not run (${SECONDS}s used)" > "$out/sweep.log"
fi
echo "===== bench_mxfp4 (the producer's routes)"; tail -n 20 "$out/bench_mxfp4.log"
echo "===== sweep (routes over prefill shapes)"; tail -n 40 "$out/sweep.log"
echo "===== tune_mxfp4_fp8 (the Triton fp8 GEMM)"; tail -n 45 "$out/tune_mxfp4_fp8.log"
echo "===== GPU tests (test_gpu_widening_bits_* and test_gpu_scaled_mm_of_the_reference_*"
echo "      say whether the cublas_fp8 route's widening or torch's fp8 GEMM is wrong)"
grep -h '^tests/' "$out/new_tests/summary.log" "$out/old_tests/summary.log"
grep -h '^FAILED' "$out/new_tests/pytest_full.log" "$out/old_tests/pytest_full.log" | cut -c1-300
echo "===== ${SECONDS}s; failed: ${#failed[@]}"
for f in "${failed[@]}"; do echo "FAILED: $f"; done
[ ${#failed[@]} -eq 0 ]
