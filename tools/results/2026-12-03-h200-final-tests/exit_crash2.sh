#!/usr/bin/env bash
# Device call of 2026-12-03 ~15:10: the sdma and op GPU tests once dedicated streams keep
# only their integer handle (no bindings object alive until the interpreter's last collection).
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for f in tests/test_sdma_gpu.py tests/test_gpu_op.py; do
    timeout 80 python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider "$f" \
        > "$out/$(basename "$f" .py).log" 2>&1; echo "$f: rc $? $(grep -c "Fatal Python" "$out/$(basename "$f" .py).log") fatal; $(grep passed "$out/$(basename "$f" .py).log")" >> "$out/summary2.log"
done
cat "$out/summary2.log"
