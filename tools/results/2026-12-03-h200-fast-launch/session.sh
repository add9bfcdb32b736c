#!/usr/bin/env bash
# Device calls of 2026-12-03 ~11:55: the by-address host path and fast launches.
#   PART=tests   GPU tests, host_steps, host_cost before/after (one round)
#   PART=compare the compare tool (M = 8192, 16384, timeline) on this tree, and at M = 8192 for
#                sdma on the tree before (the same timing code: tools/ of this tree)
# before = .before: backends/overlap/diagnostics/harness of f3d8bc4 + tools/ of this tree.
# Usage: PART=... bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
root=$PWD
export PYTHONUNBUFFERED=1
pack() { tar czf "/tmp/all.tar.gz" -C "$out" . 2>/dev/null && mv /tmp/all.tar.gz "$out/"; }
run() {  # run TREE NAME CMD...: CMD in TREE with PYTHONPATH=TREE, output to OUT/NAME.log
    local tree=$1 name=$2; shift 2
    (cd "$tree" && PYTHONPATH=$PWD timeout "${LIMIT:-200}" "$@") > "$out/$name.log" 2>&1
    echo "$name: rc $? at ${SECONDS}s" >> "$out/summary.log"; pack
}
tree_dir() { [ "$1" = before ] && echo "$root/.before" || echo "$root"; }
if [ "${PART:?PART=tests or compare}" = tests ]; then
    for f in tests/test_sdma_gpu.py tests/test_sdma_wht6_gpu.py tests/test_gpu_op.py \
             tests/test_wht6.py tests/test_oneshot_wht6.py; do
        name=t_$(basename "$f" .py)
        PYTHONPATH=$root timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
            --tb=short "$f" > "$out/$name.log" 2>&1
        echo "$f: $(tail -1 "$out/$name.log") (${SECONDS}s)" >> "$out/summary.log"; pack
    done
    run "$root" steps_after python3 -m diagnostics.host_steps --calls 1000
    for tree in before after; do
        run "$(tree_dir $tree)" "ar_$tree" python3 -m diagnostics.host_cost --backend sdma \
            --world 4 --rows 1024,2048 --calls 100
        run "$(tree_dir $tree)" "op_$tree" bash -c 'for s in 4 8; do python3 -m \
            diagnostics.host_cost --backend sdma --world 4 --rows 8192 --op-slices $s --calls 30; done'
    done
    grep -H "host " "$out"/ar_*.log "$out"/op_*.log
else
    LIMIT=420 run "$root" compare_after python3 tools/compare_backends.py --out-dir "$out/compare_after" \
        --world 4 --m 8192,16384 --slices 1,4,8 --backends sdma,sdma_wht6 --reps 20 \
        --warmup 3 --no-probe --timeline
    run "$(tree_dir before)" compare_before python3 tools/compare_backends.py \
        --out-dir "$out/compare_before" --world 4 --m 8192 --slices 1,4,8 --backends sdma \
        --reps 20 --warmup 3 --no-probe --no-png
    for tree in before after; do echo "== $tree"; grep -v "^\[" "$out/compare_$tree.log" | sed -n 4,20p; done
fi
cat "$out/summary.log"
