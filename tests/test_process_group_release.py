"""After ``overlap.shutdown()`` and ``dist.destroy_process_group()`` nothing of this package
keeps the process group alive: its gloo worker threads are joined there, not left to run
into interpreter shutdown, where one that drops a finished work item aborts the process
("terminate called without an active exception"; radiance_ar/transport/world.py says why).
Two gloo processes under torchrun, as the README's program runs."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    from radiance_ar import overlap
    from radiance_ar.transport.world import from_process_group
    from radiance_ar.overlap.config import OverlapSettings

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = threads()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    overlap.configure(from_process_group(device=torch.device("cpu")),
                      OverlapSettings(enabled=True, backend="sdma", min_m=64, slices=4))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(128, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    torch.ops.radiance.linear_ar(x, w, None, "bf16")  # the first call imports torch._dynamo
    overlap.shutdown()
    during = threads()
    dist.destroy_process_group()
    print(f"rank {rank}: threads before init {before}, before destroy {during}, "
          f"after destroy {threads()}")
""")


def test_destroy_process_group_joins_the_groups_threads(tmp_path):
    script = tmp_path / "release.py"
    script.write_text(PROGRAM)
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "1",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    printed = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    assert res.returncode == 0, printed + res.stderr[-3000:]
    counts = [line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("rank")]
    assert len(counts) == 2, printed
    for line in counts:
        words = line.replace(",", "").split()
        before, during, after = int(words[3]), int(words[6]), int(words[9])
        assert during > before, line  # the group's threads ran
        assert after == before, line  # and were joined by destroy_process_group
