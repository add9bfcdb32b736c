#!/usr/bin/env bash
# Device call 2: the host path before (.before, carried: the tree before the host-path
# commits) and after, 3 alternated rounds; a profile of the op after; GPU tests; the
# compare of sdma after with a timeline. Outputs packed in OUT/all.tar.gz.
# Usage: bash session2.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
logs=/tmp/host_path; mkdir -p $logs
root=$PWD
export PYTHONUNBUFFERED=1
run() {  # run TREE NAME CMD...: CMD in TREE with PYTHONPATH=TREE, output to LOGS/NAME.log
    local tree=$1 name=$2; shift 2
    (cd "$tree" && PYTHONPATH=$PWD timeout 200 "$@") > "$logs/$name.log" 2>&1
    echo "$name: rc $? at ${SECONDS}s" >> "$logs/summary.log"
}
for round in 1 2 3; do
    for tree in before after; do
        dir=$root; [ $tree = before ] && dir=$root/.before
        run "$dir" "ar_${tree}_$round" python3 -m diagnostics.host_cost --backend sdma \
            --world 4 --rows 1024,2048 --calls 300
        run "$dir" "op_${tree}_$round" bash -c 'for s in 4 8; do python3 -m diagnostics.host_cost \
            --backend sdma --world 4 --rows 8192 --op-slices $s --calls 60; done'
    done
done
run "$root" profile_after python3 -m diagnostics.host_cost --backend sdma --world 4 --rows 8192 \
    --op-slices 8 --calls 30 --profile --top 50
for f in tests/test_sdma_gpu.py tests/test_sdma_wht6_gpu.py tests/test_gpu_op.py; do
    PYTHONPATH=$root timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        > "$logs/t_$(basename $f .py).log" 2>&1
    echo "$f: $(tail -1 "$logs/t_$(basename $f .py).log") (${SECONDS}s)" >> "$logs/summary.log"
done
run "$root" compare_after python3 tools/compare_backends.py --out-dir $logs/compare_after \
    --world 4 --m 8192 --slices 1,4,8 --backends sdma --reps 20 --warmup 3 --no-probe --timeline
tar czf "$out/all.tar.gz" -C /tmp host_path
cat $logs/summary.log
grep -H "host " $logs/ar_*.log $logs/op_*.log
grep -v "^\[" $logs/compare_after.log | sed -n 4,40p
