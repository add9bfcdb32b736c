#!/usr/bin/env bash
# one-off: the last device call of the session, in priority order, each step started only
# while time is left (results under $1; one tarball so the file count stays small)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
out=$1/r; mkdir -p $out
step() { local limit=$1; shift; local name=$1; shift
  if [ $SECONDS -gt 470 ]; then echo "$name: not run (deadline)" >> $out/summary.log; return; fi
  timeout $limit "$@" > $out/$name.log 2>&1; echo "$name: rc $? (${SECONDS}s) $(tail -1 $out/$name.log)" >> $out/summary.log; }
for f in sdma_gpu misuse_gpu wht6 oneshot_wht6 producers mxfp4; do
  step 80 t_$f python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_$f.py
done
step 50 codec python3 tools/bench_codec.py --device cuda --no-accuracy --json $out/codec.json
step 60 bench_mxfp4 python3 tools/bench_mxfp4.py --m 8192 --n 5120 --k 4352 --json $out/bench_mxfp4.json
step 100 cmp_bf16 python3 tools/compare_backends.py --out-dir $out/bf16 --world 4 --m 8192 --slices 4 --backends sdma,sdma_wht6,oneshot_wht6 --reps 20 --no-probe
step 45 cmp_fp8 python3 tools/compare_backends.py --out-dir $out/fp8 --world 4 --m 8192 --slices 4 --backends sdma --producer fp8_rowwise --reps 20 --no-probe
step 45 cmp_mxfp4 python3 tools/compare_backends.py --out-dir $out/mxfp4 --world 4 --m 8192 --slices 4 --backends sdma --producer mxfp4_w4a8 --reps 20 --no-probe
step 40 sweep python3 tools/bench_codec.py --device cuda --no-accuracy --sweep --iters 20 --json $out/sweep.json
tar czf $1/r.tar.gz -C $1 r
cat $out/summary.log; tail -12 $out/codec.log; tail -12 $out/bench_mxfp4.log
for f in cmp_bf16 cmp_fp8 cmp_mxfp4; do grep -E "^ +(sdma|oneshot)|WRONG" $out/$f.log; done
