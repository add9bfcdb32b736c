#!/usr/bin/env bash
# Device call: GPU tests of the tree; codec kernels before (.before, carried: the tree
# before this session's host-path and codec commits) and after, alternated; the launch
# shape sweep after; the host path before/after; a profile of the op after; the compare
# of sdma_wht6/oneshot_wht6 before and after, and of sdma after with a timeline.
# Every log goes to /tmp/ch, packed into OUT/all.tar.gz after each step.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
logs=/tmp/ch; mkdir -p $logs
root=$PWD
export PYTHONUNBUFFERED=1
pack() { tar czf "$out/all.tar.gz" -C /tmp ch; }
run() {  # run TREE NAME LIMIT CMD...: CMD in TREE with PYTHONPATH=TREE, output to LOGS/NAME.log
    local tree=$1 name=$2 limit=$3; shift 3
    (cd "$tree" && PYTHONPATH=$PWD timeout "$limit" "$@") > "$logs/$name.log" 2>&1
    echo "$name: rc $? at ${SECONDS}s" >> "$logs/summary.log"; pack
}
for f in test_wht6 test_oneshot_wht6 test_sdma_wht6_gpu test_sdma_gpu test_gpu_op; do
    run "$root" "t_$f" 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/$f.py
    echo "  $(tail -1 $logs/t_$f.log)" >> "$logs/summary.log"
done
for round in 1 2; do
    run "$root/.before" "codec_before_$round" 60 python3 tools/bench_codec.py --device cuda \
        --no-accuracy --json "$logs/codec_before_$round.json"
    run "$root" "codec_after_$round" 60 python3 tools/bench_codec.py --device cuda \
        --no-accuracy --json "$logs/codec_after_$round.json"
done
run "$root" codec_sweep_after 90 python3 tools/bench_codec.py --device cuda --no-accuracy \
    --sweep --json "$logs/codec_sweep_after.json"
for round in 1; do
    for tree in before after; do
        dir=$root; [ $tree = before ] && dir=$root/.before
        run "$dir" "ar_${tree}_$round" 60 python3 -m diagnostics.host_cost --backend sdma \
            --world 4 --rows 1024,2048 --calls 300
        run "$dir" "op_${tree}_$round" 60 bash -c 'for s in 4 8; do python3 -m diagnostics.host_cost \
            --backend sdma --world 4 --rows 8192 --op-slices $s --calls 60; done'
    done
done
run "$root" profile_after 60 python3 -m diagnostics.host_cost --backend sdma --world 4 \
    --rows 8192 --op-slices 8 --calls 30 --profile --top 50
for tree in before after; do
    dir=$root; [ $tree = before ] && dir=$root/.before
    run "$dir" "cmp_wht6_$tree" 100 python3 tools/compare_backends.py --out-dir $logs/cmp_wht6_$tree \
        --world 4 --m 8192,16384 --slices 4 --backends sdma_wht6,oneshot_wht6 --reps 20 \
        --warmup 3 --no-probe --no-png
done
run "$root" cmp_sdma_after 90 python3 tools/compare_backends.py --out-dir $logs/cmp_sdma_after \
    --world 4 --m 8192 --slices 1,4,8 --backends sdma,sdma_wht6 --reps 20 --warmup 3 \
    --no-probe --timeline
cat $logs/summary.log
grep -h "encode \|decode_acc\|oneshot_wht6 W\|copy_" $logs/codec_*_1.log $logs/codec_*_2.log
grep -H "host " $logs/ar_*.log $logs/op_*.log
for f in cmp_wht6_before cmp_wht6_after cmp_sdma_after; do echo "== $f"; grep -v "^\[" $logs/$f.log | sed -n 4,40p; done
