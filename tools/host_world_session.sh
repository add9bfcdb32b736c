#!/usr/bin/env bash
# One device session for the gpu-host world (processes sharing one GPU, peer memory in
# registered shared host memory): its GPU tests, then compare_backends under torchrun with
# 2 ranks on the one GPU. Usage (on a GPU machine): tools/host_world_session.sh OUT_DIR
# Writes into OUT_DIR: pytest.log (with the 25 slowest tests), compare.log and
# compare.tar.gz (the compare tool's JSON, CSV and PNG); prints a summary table last and
# exits nonzero if the tests or the compare run failed.
set -uo pipefail
out=${1:?usage: tools/host_world_session.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
timeout "${TEST_TIMEOUT_S:-150}" python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=60 --durations=25 tests/test_host_world_gpu.py > "$out/pytest.log" 2>&1
tests_rc=$?
tests_s=$SECONDS
# Ranks share the GPU: each backend is verified with both ranks active, then timed on
# rank 0 alone against a passive peer (the header and each record say so). M = 8192: the
# size of the issue's targets (sdma link efficiency, contention).
RADIANCE_AR_PEER_MEMORY=host timeout "${COMPARE_TIMEOUT_S:-75}" \
    python3 -m torch.distributed.run --nproc-per-node 2 tools/compare_backends.py --world 2 \
    --backends sdma,oneshot_wht6 --rows 8192 --reps 5 --warmup 2 --no-probe \
    --out-dir /tmp/compare_host > "$out/compare.log" 2>&1
compare_rc=$?
tar czf "$out/compare.tar.gz" -C /tmp compare_host 2>/dev/null
{
    echo "== gpu-host session on $(cat "$out/gpu.txt")"
    grep -E "^(FAILED|ERROR) " "$out/pytest.log" | head -40
    grep -E "^# (peer memory|timing)" "$out/compare.log"
    grep -A4 -E "^ *backend " "$out/compare.log" | head -12  # the compare table
    printf "%-34s %-6s %s\n" "step" "rc" "result"
    printf "%-34s %-6s %s\n" "tests/test_host_world_gpu.py" "$tests_rc" \
        "$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$out/pytest.log" | tail -1) (${tests_s}s)"
    printf "%-34s %-6s %s\n" "torchrun compare_backends (W=2)" "$compare_rc" \
        "$(grep -cE '^WRONG' "$out/compare.log") wrong rows ($((SECONDS - tests_s))s)"
} | tee "$out/summary.log"
[ "$tests_rc" -eq 0 ] && [ "$compare_rc" -eq 0 ]
