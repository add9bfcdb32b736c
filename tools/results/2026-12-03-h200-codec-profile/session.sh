#!/usr/bin/env bash
# Device call: Nsight Compute profile of the wht6 encode and decode-accumulate (W = 4)
# kernels, and the host cost of one sdma slice. Usage: bash session.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; here=$(dirname "$0"); mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ncu --version > "$out/ncu.log" 2>&1
timeout 240 ncu -k regex:wht6_encode_kernel --launch-skip 1 --launch-count 1 --set full \
    --import-source no -f -o /tmp/enc python3 "$here/ncu_driver.py" >> "$out/ncu.log" 2>&1
timeout 240 ncu -k regex:wht6_decode_accumulate_kernel --launch-skip 0 --launch-count 1 --set full \
    --import-source no -f -o /tmp/dec python3 "$here/ncu_driver.py" >> "$out/ncu.log" 2>&1
for k in enc dec; do
    ncu -i /tmp/$k.ncu-rep --page details > "$out/${k}_details.txt" 2>&1
    ncu -i /tmp/$k.ncu-rep --page source --csv --print-source sass > /tmp/${k}_sass.csv 2>&1
done
timeout 200 python3 -m diagnostics.host_cost --backend sdma --world 4 --rows 1024,2048 \
    --calls 100 --profile --top 40 > "$out/host_cost_sdma.log" 2>&1
tar czf "$out/profiles.tar.gz" -C /tmp enc.ncu-rep dec.ncu-rep enc_sass.csv dec_sass.csv
tail -5 "$out/ncu.log"; grep -n "Duration\|DRAM Throughput\|Compute (SM)\|Achieved Occupancy\|Registers Per" "$out"/*_details.txt
