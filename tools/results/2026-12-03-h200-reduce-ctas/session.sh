#!/usr/bin/env bash
# Device call: the sdma reduce's CTA budget (RADIANCE_AR_SDMA_REDUCE_CTAS) side by side,
# 4 emulated ranks on one GPU, M = 8192, S = 4 and 8, 20 repeats; then the sdma GPU tests.
# Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for c in 0 33 66 132 528; do
    echo "== RADIANCE_AR_SDMA_REDUCE_CTAS=$c" >> "$out/sweep.log"
    RADIANCE_AR_SDMA_REDUCE_CTAS=$c timeout 150 python3 tools/compare_backends.py --world 4 \
        --m 8192 --slices 4,8 --backends sdma --reps 20 --warmup 3 --no-probe \
        --out-dir /tmp/sweep/ctas_$c >> "$out/sweep.log" 2>&1
    echo "rc $? at ${SECONDS}s" >> "$out/sweep.log"
done
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_sdma_gpu.py \
    > "$out/pytest_sdma.log" 2>&1
tail -1 "$out/pytest_sdma.log"
tar czf "$out/sweep.tar.gz" -C /tmp sweep
grep -E "^==|^ +sdma|rc " "$out/sweep.log"
