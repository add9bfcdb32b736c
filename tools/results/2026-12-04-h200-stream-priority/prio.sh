#!/usr/bin/env bash
out=$1; mkdir -p $out/p; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
args="--m 8192 --slices 1,2,4 --backends sdma,sdma_wht6 --reps 20 --warmup 3 --no-probe --no-png"
for w in 4 2; do
  timeout 70 python3 results/prio.py --world $w $args --out-dir $out/p/prio-w$w > $out/p/prio-w$w.log 2>&1; echo "prio w$w rc $?" >> $out/summary.txt
  timeout 70 python3 tools/compare_backends.py --world $w $args --out-dir $out/p/base-w$w > $out/p/base-w$w.log 2>&1; echo "base w$w rc $?" >> $out/summary.txt
done
tar czf $out/prio.tar.gz -C $out p
cat $out/summary.txt
for f in $out/p/*.log; do echo "== $f"; grep -E "^ +(sdma|sdma_wht6) " $f | awk '{print $1, $3, $4, $9, $10, $12}'; done
