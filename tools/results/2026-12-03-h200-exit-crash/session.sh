#!/usr/bin/env bash
# Device call of 2026-12-03 ~15:50: find the exit crash of GPU pytest processes
# (a native backtrace under cuda-gdb, then a bisect of the stream source), then every GPU
# test file with its exit status.
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T=tests/test_sdma_gpu.py
if command -v cuda-gdb > /dev/null; then
    timeout 150 cuda-gdb -q -batch -ex "set pagination off" -ex "set confirm off" \
        -ex "set cuda api_failures ignore" -ex run -ex "bt 40" -ex "info threads" \
        --args python3 -m pytest -q -m gpu -p no:cacheprovider "$T" > "$out/gdb.log" 2>&1
    echo "gdb: rc $? at ${SECONDS}s" >> "$out/summary.log"
fi
probe() {  # name, call streams, stream source (dedicated | pool | ctypes)
    RADIANCE_AR_SDMA_CALL_STREAMS=$2 timeout 60 python3 -X faulthandler -c "
import ctypes, sys, pytest, torch
import backends.copy_engine as ce
src = '$3'
if src != 'dedicated':
    import backends.publish_lane, backends.copy_transport, backends.call_streams
    import backends.gpu_signals, harness.emulated
    if src == 'pool':
        make = lambda device: torch.cuda.Stream(device)
    else:  # the runtime library torch itself loaded, through ctypes
        torch.cuda.init()
        path = next(l.split()[-1] for l in open('/proc/self/maps') if 'libcudart' in l)
        rt = ctypes.CDLL(path)
        def make(device):
            with torch.cuda.device(device):
                h = ctypes.c_void_p()
                assert rt.cudaStreamCreateWithFlags(ctypes.byref(h), 1) == 0
            return torch.cuda.ExternalStream(h.value, device=device)
    for m in (ce, backends.publish_lane, backends.copy_transport, backends.call_streams,
              backends.gpu_signals, harness.emulated):
        m.dedicated_stream = make
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '$T']))
" > "$out/$1.log" 2>&1
    echo "$1: rc $? $(grep -c 'Fatal Python' "$out/$1.log") fatal; $(grep -E 'passed|failed' "$out/$1.log" | tail -1)" >> "$out/summary.log"
}
probe dedicated 2 dedicated
probe cs1 1 dedicated
probe pool 2 pool
probe ctypes 2 ctypes
grep -l libcudart /proc/self/maps > /dev/null 2>&1
python3 -c "import torch; torch.cuda.init(); print([l.split()[-1] for l in open('/proc/self/maps') if 'cudart' in l][:2]); import cuda.bindings, importlib.metadata as m; print('cuda-bindings', m.version('cuda-bindings'))" >> "$out/summary.log" 2>&1
DEADLINE_S=${DEADLINE_S:-250} bash tools/gpu_session.sh "$out/tests" > /dev/null 2>&1
cat "$out/tests/summary.log" >> "$out/summary.log"
cat "$out/summary.log"
tail -60 "$out/gdb.log" 2>/dev/null
