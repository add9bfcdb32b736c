#!/usr/bin/env bash
# Device call: the encode rewrite's GPU tests (bits against the reference; the fused
# one-shot kernel shares encode_tile), each followed by one codec bench. Logs in /tmp/enc,
# packed into OUT/all.tar.gz after each step. Usage: bash session.sh OUT
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
logs=/tmp/enc; mkdir -p $logs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pack() { tar czf "$out/all.tar.gz" -C /tmp enc; }
round=0
for f in test_wht6 test_oneshot_wht6; do
    timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/$f.py \
        > $logs/t_$f.log 2>&1
    echo "$f: $(tail -1 $logs/t_$f.log) (${SECONDS}s)" >> $logs/summary.log; pack
    round=$((round + 1))
    timeout 40 python3 tools/bench_codec.py --device cuda --no-accuracy \
        --json $logs/codec_$round.json > $logs/codec_$round.log 2>&1
    echo "codec $round: rc $? (${SECONDS}s)" >> $logs/summary.log; pack
done
cat $logs/summary.log; grep -h "^copy_\|^encode\|^decode_acc\|^oneshot" $logs/codec_*.log
