#!/usr/bin/env bash
# One device session for the gpu-host world (processes sharing one GPU, peer memory in
# registered shared host memory), about 5 minutes on one H200: its GPU tests; then
# compare_backends under torchrun at 2 and 4 processes and in the emulated world at the
# same W (the host time per op call of each beside the other); then prefill_bench under
# torchrun at 2 processes (verified, not timed: ranks sharing a GPU time-slice it).
# Usage (on a GPU machine, from the repository root): tools/host_world_session.sh OUT_DIR
# Writes into OUT_DIR: pytest.log, summary.log and logs.tar.gz (every step's log and the
# tools' JSON, CSV and PNG); prints a summary table last and exits nonzero if a step failed.
set -uo pipefail
out=${1:?usage: tools/host_world_session.sh OUT_DIR}
mkdir -p "$out"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$work/gpu.txt" 2>&1
steps=()  # "name rc seconds"
step() {  # step NAME TIMEOUT_S COMMAND...: run it with its log in $work/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$work/$name.log" 2>&1
    local rc=$?
    steps+=("$name $rc $((SECONDS - start))")
    return 0
}
step pytest "${TEST_TIMEOUT_S:-120}" python3 -m pytest -v -m gpu -p no:cacheprovider \
    --tb=short -o faulthandler_timeout=60 --durations=25 tests/test_host_world_gpu.py
cp "$work/pytest.log" "$out/pytest.log"
# M = 8192: the size of the issue's targets (sdma link efficiency, contention). Options
# after the script name use compare's torchrun-safe spellings (--rows, not --m).
compare=(--backends sdma,sdma_wht6,oneshot_wht6 --rows 8192 --reps 20 --warmup 3 --no-probe
         --no-png)
jsons=()
for w in 2 4; do
    step "compare_host_w$w" "${COMPARE_TIMEOUT_S:-40}" env RADIANCE_AR_PEER_MEMORY=host \
        python3 -m torch.distributed.run --nproc-per-node "$w" tools/compare_backends.py \
        --world "$w" "${compare[@]}" --out-dir "$work/compare_host_w$w"
    step "compare_emulated_w$w" "${EMULATED_TIMEOUT_S:-25}" python3 tools/compare_backends.py \
        --mode emulated --world "$w" "${compare[@]}" --out-dir "$work/compare_emulated_w$w"
    jsons+=("$work/compare_host_w$w/compare.json" "$work/compare_emulated_w$w/compare.json")
done
step prefill_host_w2 "${PREFILL_TIMEOUT_S:-30}" env RADIANCE_AR_PEER_MEMORY=host \
    python3 -m torch.distributed.run --nproc-per-node 2 tools/prefill_bench.py \
    --model llama-3.1-8b --tp 2 --layers 2 --tokens 4096 --chunk 2048 \
    --backends sdma,sdma_wht6,oneshot_wht6 --no-png --out-dir "$work/prefill_host_w2"
python3 tools/host_world_summary.py "${jsons[@]}" > "$work/figures.log" 2>&1
figures_rc=$?
tar czf "$out/logs.tar.gz" -C "$work" .
{
    echo "== gpu-host session on $(cat "$work/gpu.txt")"
    grep -E "^(FAILED|ERROR) " "$work/pytest.log" | head -40
    grep -hE "^# (peer memory|timing)" "$work"/compare_host_w2.log "$work"/prefill_host_w2.log
    grep -hE "^(WRONG|prefill_bench:)|Error:" "$work"/compare_*.log "$work"/prefill_*.log | head -20
    cat "$work/figures.log"
    printf "%-24s %-4s %-6s %s\n" "step" "rc" "s" "result"
    for s in "${steps[@]}"; do
        read -r name rc secs <<< "$s"
        case $name in
            pytest) result=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$work/pytest.log" |
                             tail -1) ;;
            *) result="$(grep -cE 'WRONG' "$work/$name.log") WRONG rows" ;;
        esac
        printf "%-24s %-4s %-6s %s\n" "$name" "$rc" "$secs" "$result"
    done
    printf "%-24s %-4s %-6s %s\n" "figures (targets)" "$figures_rc" "-" "host_world_summary.py"
} | tee "$out/summary.log"
rm -rf "$work"
failed=$figures_rc
for s in "${steps[@]}"; do
    read -r _ rc _ <<< "$s"
    [ "$rc" -eq 0 ] || failed=1
done
exit "$failed"
