#!/usr/bin/env bash
# One device session: the main job in the emulated world where compare flags are given,
# then the GPU tests.
# Usage (on a GPU machine): tools/gpu_session.sh OUT_DIR [compare flags...]
# Writes into OUT_DIR: summary.log, pytest_full.log and, with compare flags, compare.log and
# compare.tar.gz (the compare tool's JSON, CSV, PNGs and timeline): few files, because a
# lent device returns few.
# GPU_TESTS (space-separated test files) narrows the tests (default: every file marked gpu);
# DEADLINE_S (default 540) stops starting test files once that many seconds have passed;
# FILE_TIMEOUT_S (default 120) bounds each file, except the gpu-host world's, whose 39 cases of
# processes took 265 s on an H100 (tools/results/2026-12-05-h100-two-streams-and-gpu-tests/):
# it gets 330 s unless FILE_TIMEOUT_S is set. A file still running then gets the native stacks
# of its threads written into its log (gdb, where installed: what a blocked CUDA call waits in)
# before it is killed.
set -uo pipefail
out=${1:?usage: tools/gpu_session.sh OUT_DIR [compare flags...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/summary.log" 2>&1
if [ $# -gt 0 ]; then
    timeout 300 python3 tools/compare_backends.py --out-dir /tmp/compare "$@" \
        > "$out/compare.log" 2>&1
    echo "compare: rc $? after ${SECONDS}s" >> "$out/summary.log"
    tar czf "$out/compare.tar.gz" -C /tmp compare
fi
# One pytest process per file: a CUDA error in one file cannot poison the next.
for f in ${GPU_TESTS:-$(grep -l "mark.gpu" tests/test_*.py)}; do
    if [ "$SECONDS" -gt "${DEADLINE_S:-540}" ]; then
        echo "$f: not run (deadline)" >> "$out/summary.log"; continue
    fi
    log=/tmp/gpu_session_$(basename "$f" .py).log  # this file's output only
    python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -o faulthandler_timeout=60 "$f" > "$log" 2>&1 &
    pid=$! waited=0 limit=${FILE_TIMEOUT_S:-120}
    [ -z "${FILE_TIMEOUT_S:-}" ] && [ "$(basename "$f")" = test_host_world_gpu.py ] && limit=330
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do
        sleep 1; waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then  # over its time: how it blocks, then stop it
        if command -v gdb > /dev/null; then
            { printf "\n== still running after %ss: native stacks\n" "$waited"
              timeout 60 gdb -p "$pid" -batch -iex "set auto-load off" -ex "thread apply all bt 30" 2>&1 | grep -v '^\[New LWP'
            } >> "$log"
        fi
        pkill -9 -P "$pid" 2>/dev/null; kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rc=124
    else
        wait "$pid"; rc=$?  # kept: a crash at interpreter exit (139) follows the pytest summary line
    fi
    { echo "===== $f"; cat "$log"; } >> "$out/pytest_full.log"
    verdict=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -1)  # pytest's last line
    echo "$f: rc $rc: ${verdict:-no pytest summary (killed or crashed first)} (${SECONDS}s)" \
        >> "$out/summary.log"
done
cat "$out/summary.log"; tail -40 "$out/compare.log" 2>/dev/null
