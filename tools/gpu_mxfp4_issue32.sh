#!/usr/bin/env bash
# The MXFP4 W4A8 producer on one H200 in about 7 minutes: its GPU tests, the GEMM routes
# at 8192 x 5120 x 4352 beside torch's bf16 and fp8 rowwise GEMMs, the routes over the
# prefill shapes, then end to end: compare_backends with --producer mxfp4_w4a8 (and bf16
# beside it) at 2 and 4 emulated ranks, and the prefill bench of Llama-3.1-70B TP 4 with
# each producer.
# Usage (on a GPU machine, repository root): tools/gpu_mxfp4_issue32.sh OUT_DIR
# Writes into OUT_DIR: bench_mxfp4.{log,json}, sweep.{log,json}, tests/ (tools/gpu_session.sh's
# summary.log and pytest_full.log), compare_<producer>_w<W>/ and prefill_<producer>/
# (each tool's JSON, CSV and log). Exits 1 if any step failed.
set -uo pipefail
out=${1:?usage: tools/gpu_mxfp4_issue32.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
failed=()
run() {  # run NAME TIMEOUT_S COMMAND...: its log in $out/NAME.log
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1 || failed+=("$name rc $?")
}
GPU_TESTS="tests/test_mxfp4_fp8_gemm.py tests/test_mxfp4_routes.py tests/test_mxfp4.py
           tests/test_producers.py" DEADLINE_S=150 tools/gpu_session.sh "$out/tests" > /dev/null
grep -E '^tests/' "$out/tests/summary.log" | grep -vE ': rc 0: [0-9]+ passed' | while read -r l; do
    echo "$l"; done > "$out/tests_failed.log"
[ -s "$out/tests_failed.log" ] && failed+=("GPU tests: $(cat "$out/tests_failed.log")")
run bench_mxfp4 60 python3 tools/bench_mxfp4.py --config 256,128,64,8,1,1,8,3,bf16 --reps 20 \
    --json "$out/bench_mxfp4.json"
run sweep 90 python3 tools/bench_mxfp4.py --sweep --sweep-rows 256,2048,4096,16384 --reps 5 \
    --warmup 2 --json "$out/sweep.json"
for producer in mxfp4_w4a8 bf16; do
    for w in 2 4; do
        run "compare_${producer}_w$w" 90 python3 tools/compare_backends.py --mode emulated \
            --world "$w" --m 8192 --backends sdma,sdma_wht6 --producer "$producer" --reps 20 \
            --warmup 3 --no-probe --no-png --out-dir "$out/compare_${producer}_w$w"
    done
    run "prefill_$producer" 120 python3 tools/prefill_bench.py --model llama-3.1-70b --tp 4 \
        --layers 2 --tokens 8192 --chunk 8192 --backends sdma,sdma_wht6 --producer "$producer" \
        --reps 10 --warmup 2 --no-png --out-dir "$out/prefill_$producer"
done
echo "===== GPU tests"; grep -h '^tests/' "$out/tests/summary.log"
grep -h '^FAILED' "$out/tests/pytest_full.log" | cut -c1-300
echo "===== bench_mxfp4"; tail -n 14 "$out/bench_mxfp4.log"
echo "===== sweep"; tail -n 26 "$out/sweep.log"
for f in "$out"/compare_*.log "$out"/prefill_*.log; do
    echo "===== $(basename "$f")"; grep -vE '^\s*$' "$f" | tail -n 14 | cut -c1-220
done
echo "===== ${SECONDS}s; failed: ${#failed[@]}"
for f in "${failed[@]}"; do echo "FAILED: $f"; done
[ ${#failed[@]} -eq 0 ]
