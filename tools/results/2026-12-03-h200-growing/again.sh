#!/usr/bin/env bash
# Device call of 2026-12-03 ~16:28: uniform against growing slices again (S = 4, 5), with
# timelines; every output in one tarball (a device call returns few files).
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 250 python3 tools/compare_backends.py --world 4 --m 8192,16384 --slices 4,5 \
    --plans uniform,growing --backends sdma --reps 20 --warmup 3 --no-probe --timeline \
    --out-dir /tmp/again > "$out/again.log" 2>&1
echo "again rc $? at ${SECONDS}s" >> "$out/summary.log"
tar czf "$out/again.tar.gz" -C /tmp again
cat "$out/summary.log"; grep -E "^ +sdma" "$out/again.log"
