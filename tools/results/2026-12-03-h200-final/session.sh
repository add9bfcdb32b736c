#!/usr/bin/env bash
# Device call: the final tree (pipeline order reverted to every GEMM first): the GPU tests
# of the op and of oneshot_wht6, then the main job for sdma and sdma_wht6 with a timeline.
# Logs in /tmp/final, packed into OUT/all.tar.gz after each step. Usage: bash session.sh OUT
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
logs=/tmp/final; mkdir -p $logs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pack() { tar czf "$out/all.tar.gz" -C /tmp final; }
for f in test_oneshot_wht6 test_gpu_op test_sdma_gpu; do
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/$f.py \
        > $logs/t_$f.log 2>&1
    echo "$f: $(tail -1 $logs/t_$f.log) (${SECONDS}s)" >> $logs/summary.log; pack
done
timeout 150 python3 tools/compare_backends.py --out-dir $logs/compare --world 4 --m 8192 \
    --slices 1,4,8 --backends sdma,sdma_wht6 --reps 20 --warmup 3 --no-probe --timeline \
    > $logs/compare.log 2>&1
echo "compare: rc $? (${SECONDS}s)" >> $logs/summary.log; pack
cat $logs/summary.log; grep -v "^\[" $logs/compare.log | sed -n 4,60p
