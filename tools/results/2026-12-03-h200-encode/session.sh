#!/usr/bin/env bash
# Device call: the encode rewrite's GPU tests (bits against the reference), then the codec
# bench twice. Logs in /tmp/enc, packed into OUT/all.tar.gz. Usage: bash session.sh OUT
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
logs=/tmp/enc; mkdir -p $logs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pack() { tar czf "$out/all.tar.gz" -C /tmp enc; }
for f in test_wht6 test_oneshot_wht6 test_sdma_wht6_gpu; do
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/$f.py \
        > $logs/t_$f.log 2>&1
    echo "$f: $(tail -1 $logs/t_$f.log) (${SECONDS}s)" >> $logs/summary.log; pack
done
for round in 1 2; do
    timeout 60 python3 tools/bench_codec.py --device cuda --no-accuracy \
        --json $logs/codec_$round.json > $logs/codec_$round.log 2>&1
    echo "codec $round: rc $? (${SECONDS}s)" >> $logs/summary.log; pack
done
cat $logs/summary.log; grep -h "^copy_\|^encode\|^decode_acc" $logs/codec_*.log
