#!/usr/bin/env bash
# Device call of 2026-12-03 ~15:15: bisect the exit crash of GPU pytest processes: the sdma
# GPU tests with one call stream, with torch pool streams in place of dedicated ones, both.
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
probe() {  # name, call streams, pool (0/1)
    RADIANCE_AR_SDMA_CALL_STREAMS=$2 timeout 60 python3 -X faulthandler -c "
import sys, pytest, torch
if $3:
    import backends.copy_engine, backends.publish_lane, backends.copy_transport
    import backends.call_streams, backends.gpu_signals, harness.emulated
    for m in (backends.copy_engine, backends.publish_lane, backends.copy_transport,
              backends.call_streams, backends.gpu_signals, harness.emulated):
        m.dedicated_stream = lambda device: torch.cuda.Stream(device)
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_sdma_gpu.py']))
" > "$out/$1.log" 2>&1
    echo "$1: rc $? $(grep -c 'Fatal Python' "$out/$1.log") fatal; $(grep -E 'passed|failed' "$out/$1.log" | tail -1)" >> "$out/summary3.log"
}
probe cs1 1 0
probe pool 2 1
probe cs1_pool 1 1
cat "$out/summary3.log"
