#!/usr/bin/env bash
# Device call: the host path before (.before: a git archive of the parent commit,
# carried) and after, alternated in one process tree on one machine; then GPU tests.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
root=$PWD
export PYTHONUNBUFFERED=1
run() {  # run TREE NAME CMD...: CMD in TREE with PYTHONPATH=TREE, output to OUT/NAME.log
    local tree=$1 name=$2; shift 2
    (cd "$tree" && PYTHONPATH=$PWD timeout 200 "$@") > "$out/$name.log" 2>&1
    echo "$name: rc $? at ${SECONDS}s" >> "$out/summary.log"
}
for round in 1 2; do
    for tree in before after; do
        dir=$root; [ $tree = before ] && dir=$root/.before
        run "$dir" "ar_${tree}_$round" python3 -m diagnostics.host_cost --backend sdma \
            --world 4 --rows 1024,2048 --calls 100
        run "$dir" "op_${tree}_$round" bash -c 'for s in 4 8; do python3 -m diagnostics.host_cost \
            --backend sdma --world 4 --rows 8192 --op-slices $s --calls 30; done'
    done
done
for tree in before after; do
    dir=$root; [ $tree = before ] && dir=$root/.before
    run "$dir" "compare_$tree" python3 tools/compare_backends.py --out-dir "$out/compare_$tree" \
        --world 4 --m 8192 --slices 1,4,8 --backends sdma,sdma_wht6 --reps 20 --warmup 3 \
        --no-probe --no-png
done
for f in tests/test_sdma_gpu.py tests/test_sdma_wht6_gpu.py tests/test_gpu_op.py \
         tests/test_misuse_gpu.py; do
    PYTHONPATH=$root timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        > "$out/t_$(basename $f .py).log" 2>&1
    echo "$f: $(tail -1 "$out/t_$(basename $f .py).log") (${SECONDS}s)" >> "$out/summary.log"
done
cat "$out/summary.log"
grep -H "host " "$out"/ar_*.log "$out"/op_*.log | head -40
for tree in before after; do echo "== $tree"; grep -v "^\[" "$out/compare_$tree.log" | sed -n 4,20p; done
