"""Run a script with Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before
Triton is imported, hence a subprocess); the script prints ``interpreter-ok`` at its end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_under_interpreter(script: str, timeout_s: float = 300.0) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout_s)
    assert res.returncode == 0 and "interpreter-ok" in res.stdout, res.stderr[-3000:]
