#!/usr/bin/env bash
# final device batch: the fixed GPU test, the compare sweep (issue 29 item 5), prefill 8B TP 2
out=$1; mkdir -p $out/c; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_sdma_wht6_gpu.py > $out/c/test_sdma_wht6_gpu.log 2>&1; echo "test rc $?" >> $out/summary.txt
for w in 2 4; do
  timeout 170 python3 tools/compare_backends.py --world $w --m 2048,4096,8192,16384 --slices 1,4,8 --backends sdma,sdma_wht6 --reps 20 --warmup 3 --no-probe --no-png --out-dir $out/c/compare-w$w > $out/c/compare-w$w.log 2>&1; echo "compare w$w rc $?" >> $out/summary.txt
done
timeout 100 python3 tools/prefill_bench.py --model llama-3.1-8b --tp 2 --backends sdma,sdma_wht6,oneshot_wht6 --no-png --out-dir $out/c/prefill-8b-tp2 > $out/c/prefill-8b-tp2.log 2>&1; echo "prefill rc $?" >> $out/summary.txt
tar czf $out/final.tar.gz -C $out c
cat $out/summary.txt
