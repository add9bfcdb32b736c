#!/usr/bin/env bash
# Device call of 2026-12-03 ~14:50: which change removes the doubled host time of an op
# call at S = 8 with two call streams (host_variants.py), against one call stream.
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
here=tools/results/2026-12-03-h200-call-streams
for v in base nogc pool conn32; do
    for s in 8 4; do
        echo "== cs2 $v S=$s: $(RADIANCE_AR_SDMA_CALL_STREAMS=2 timeout 60 python3 $here/host_variants.py $v $s 2>&1 | tail -1)" >> "$out/variants.log"
    done
done
for v in base conn32; do
    echo "== cs1 $v S=8: $(RADIANCE_AR_SDMA_CALL_STREAMS=1 timeout 60 python3 $here/host_variants.py $v 8 2>&1 | tail -1)" >> "$out/variants.log"
done
cat "$out/variants.log"
