#!/usr/bin/env bash
# Device call of 2026-12-03 (afternoon): the by-address host path and fast launches.
# In order, each step started only while under DEADLINE_S (default 540) seconds:
#   the GPU tests of sdma, the op and sdma_wht6; the compare tool on this tree (M = 8192,
#   S = 1, 4, 8, sdma and sdma_wht6, timeline); the compare tool for sdma on the tree before
#   (.before: backends/overlap/diagnostics/harness of f3d8bc4 + tools/ of this tree, so the
#   same timing code); the GPU tests of the codec kernels and oneshot_wht6; host_cost of
#   the op at S = 4 and 8 on both trees.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
root=$PWD
export PYTHONUNBUFFERED=1
pack() { tar czf "/tmp/all.tar.gz" -C "$out" . 2>/dev/null && mv /tmp/all.tar.gz "$out/"; }
late() { [ "$SECONDS" -gt "${DEADLINE_S:-540}" ] && echo "$1: not run (deadline)" >> "$out/summary.log"; }
run() {  # run TREE NAME LIMIT CMD...: CMD in TREE with PYTHONPATH=TREE, output to OUT/NAME.log
    local tree=$1 name=$2 limit=$3; shift 3
    late "$name" && return
    (cd "$tree" && PYTHONPATH=$PWD timeout "$limit" "$@") > "$out/$name.log" 2>&1
    echo "$name: rc $? at ${SECONDS}s" >> "$out/summary.log"; pack
}
gpu_test() {  # gpu_test FILE
    run "$root" "t_$(basename "$1" .py)" 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
        --tb=short "$1"
    tail -1 "$out/t_$(basename "$1" .py).log" >> "$out/summary.log" 2>/dev/null
}
for f in tests/test_sdma_gpu.py tests/test_gpu_op.py tests/test_sdma_wht6_gpu.py; do gpu_test "$f"; done
run "$root" compare_after 240 python3 tools/compare_backends.py --out-dir "$out/compare_after" \
    --world 4 --m 8192 --slices 1,4,8 --backends sdma,sdma_wht6 --reps 20 --warmup 3 \
    --no-probe --timeline
run "$root/.before" compare_before 120 python3 tools/compare_backends.py \
    --out-dir "$out/compare_before" --world 4 --m 8192 --slices 4,8 --backends sdma \
    --reps 20 --warmup 3 --no-probe --no-png
for f in tests/test_wht6.py tests/test_oneshot_wht6.py; do gpu_test "$f"; done
for tree in after before; do
    dir=$root; [ $tree = before ] && dir=$root/.before
    run "$dir" "op_$tree" 60 bash -c 'for s in 4 8; do python3 -m diagnostics.host_cost \
        --backend sdma --world 4 --rows 8192 --op-slices $s --calls 30; done'
done
cat "$out/summary.log"
for tree in before after; do echo "== $tree"; grep -v "^\[" "$out/compare_$tree.log" 2>/dev/null | sed -n 4,20p; done
grep -H "host " "$out"/op_*.log 2>/dev/null
