"""The README's "Using the op" program, run as written under torchrun with 2 CPU
processes, so the front door's example cannot rot."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_program() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Using the op", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_using_the_op_program_runs_and_is_right(tmp_path):
    script = tmp_path / "demo.py"
    script.write_text(readme_program())
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    # Each rank's stdout to a file of its own (--redirects 1): two ranks printing to one
    # pipe can interleave their lines.
    logs = tmp_path / "logs"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "1",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    printed = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    assert res.returncode == 0, printed + res.stdout[-2000:] + res.stderr[-4000:]
    errors = re.findall(r"rank (\d): out \(256, 1024\), relative RMS error vs float64 (\S+)",
                        printed)
    assert sorted(r for r, _ in errors) == ["0", "1"], printed
    assert all(float(e) <= 2 ** -8 for _, e in errors), errors
