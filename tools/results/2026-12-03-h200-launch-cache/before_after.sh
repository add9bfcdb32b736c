#!/usr/bin/env bash
# Device call: host time per step with the launch cache, then with it bypassed (every
# launch through the JIT, as before), in one process each on the same machine.
# Usage: bash before_after.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python3 -m diagnostics.host_steps --calls 2000 > "$out/host_steps_cached.log" 2>&1
timeout 100 python3 - > "$out/host_steps_jit.log" 2>&1 <<'PY'
import runpy
from backends.kernels import launch_cache
# bypass: every launch through the JIT's kernel[grid](...), as before the cache
launch_cache.CachedLaunch.__call__ = (
    lambda self, grid, args, constexprs, options: self.kernel[grid](*args, **constexprs, **options))
runpy.run_module("diagnostics.host_steps", run_name="__main__")
PY
paste "$out/host_steps_cached.log" "$out/host_steps_jit.log"
