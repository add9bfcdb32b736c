#!/usr/bin/env bash
# One device session: GPU tests, then the main job in the emulated and torchrun worlds.
# Usage (on a GPU machine): tools/gpu_session.sh OUT_DIR [compare flags...]
# Logs and results land in OUT_DIR; the summary table is printed last.
set -uo pipefail
out=${1:?usage: tools/gpu_session.sh OUT_DIR [compare flags...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
# One pytest process per file: a CUDA error in one file cannot poison the next.
# Full logs in one file (the device returns at most 8 files); a summary line per file.
for f in $(grep -l "mark.gpu" tests/test_*.py); do
    echo "===== $f" >> "$out/pytest_gpu_full.log"
    timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short "$f" \
        >> "$out/pytest_gpu_full.log" 2>&1
    echo "$f: $(tail -1 "$out/pytest_gpu_full.log")" >> "$out/pytest_gpu.log"
done
timeout 300 python3 tools/compare_backends.py --out-dir "$out" "$@" > "$out/compare.log" 2>&1
timeout 120 torchrun --nproc-per-node 1 tools/compare_backends.py --quick --no-probe \
    --out-dir /tmp/torchrun1 --no-png > "$out/torchrun1.log" 2>&1
cat "$out/gpu.txt" "$out/pytest_gpu.log"; tail -30 "$out/compare.log"; tail -15 "$out/torchrun1.log"
