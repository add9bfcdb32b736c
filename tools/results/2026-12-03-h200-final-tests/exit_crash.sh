#!/usr/bin/env bash
# Device call of 2026-12-03 ~15:00: where pytest processes segfault at exit (every GPU test
# passed, 6 of 10 files' processes crashed at exit since streams are dedicated): the sdma
# GPU tests under faulthandler, as they are and with the dedicated streams never destroyed.
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 80 python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider tests/test_sdma_gpu.py \
    > "$out/as_is.log" 2>&1; echo "as is: rc $?" >> "$out/summary.log"
timeout 80 python3 -X faulthandler -c "
import sys, pytest
import backends.copy_engine as c
c._destroy_stream = lambda destroy, raw: None
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_sdma_gpu.py']))
" > "$out/no_destroy.log" 2>&1; echo "no destroy: rc $?" >> "$out/summary.log"
cat "$out/summary.log"; grep -v "^\.\|^$" "$out/as_is.log" | head -40; tail -5 "$out/no_destroy.log"
