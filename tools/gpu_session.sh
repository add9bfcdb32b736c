#!/usr/bin/env bash
# One device session: GPU tests, codec throughput, contention breakdown, then the main
# job in the emulated world and a one-rank torchrun smoke run.
# Usage (on a GPU machine): tools/gpu_session.sh OUT_DIR [compare flags...]
# Writes 7 files into OUT_DIR (summary.log, pytest_full.log, extras.log, compare.*).
set -uo pipefail
out=${1:?usage: tools/gpu_session.sh OUT_DIR [compare flags...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/summary.log" 2>&1
# One pytest process per file: a CUDA error in one file cannot poison the next.
for f in $(grep -l "mark.gpu" tests/test_*.py); do
    echo "===== $f" >> "$out/pytest_full.log"
    timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        >> "$out/pytest_full.log" 2>&1
    echo "$f: $(tail -1 "$out/pytest_full.log")" >> "$out/summary.log"
done
{
    echo "===== bench_codec"; timeout 120 python3 tools/bench_codec.py --quick
    echo "===== contention_breakdown"
    timeout 150 python3 tools/contention_breakdown.py --world 4 --backends sdma,sdma_wht6
    echo "===== torchrun, 1 rank"
    timeout 120 torchrun --nproc-per-node 1 tools/compare_backends.py --quick --no-probe \
        --out-dir /tmp/torchrun1 --no-png
} > "$out/extras.log" 2>&1
timeout 420 python3 tools/compare_backends.py --out-dir "$out" "$@" > "$out/compare.log" 2>&1
cat "$out/summary.log"; tail -40 "$out/extras.log"; tail -25 "$out/compare.log"
