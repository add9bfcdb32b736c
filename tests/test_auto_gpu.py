"""RADIANCE_AR_BACKEND=auto on one GPU (W = 2 emulated ranks): a tune run at two M values
writes a tuning file, the op under ``auto`` is right on every rank against float64, and
it runs the best measured row of each accuracy class. Its time, taken as tools/tune.py
times a case (one active rank, passive peers), is recorded beside the tuned row's, not
asserted: speed is a benchmark's (tools/gpu_check_auto.sh reports the ratio).

``--basetemp`` keeps the tune run's file and log and this test's records (auto.json):
tools/gpu_check_auto.sh passes one under $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import gpu_timing
import world_jobs
from emulated_measure import poison_allocator
from radiance_ar import overlap
from radiance_ar.envs import ACCURACY_CLASSES, BackendSettings
from radiance_ar.harness.emulated import EmulatedRanks
from radiance_ar.overlap import tuning
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.transport.world import emulated_worlds

pytestmark = pytest.mark.gpu
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEV = torch.device("cuda", 0)
W, N, K = 2, 5120, 4352  # compare_backends' GPU shape (one rank's down_proj)
M_VALUES = (4096, 8192)
REPS, WARMUP = 10, 3


def auto_settings(path: str, accuracy: str, timeout_ms: float = 1000.0) -> OverlapSettings:
    return OverlapSettings(True, "auto", 1, "auto", BackendSettings(spin_timeout_ms=timeout_ms),
                           tuning=path, accuracy=accuracy)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> str:
    """The tune run: W = 2, two M values, every emulated backend at S = 1 and 4."""
    folder = tmp_path_factory.mktemp("tune")
    out = str(folder / "tuning-w2.json")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "tune.py"), "--world", str(W),
           "--m", ",".join(map(str, M_VALUES)), "--n", str(N), "--k", str(K),
           "--backends", "sdma,sdma_wht6,oneshot_wht6", "--slices", "1,4", "--plans", "uniform",
           "--reps", str(REPS), "--warmup", str(WARMUP), "--max-minutes", "2", "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    with open(folder / "tune.log", "w") as f:
        f.write(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.mark.parametrize("source, size, rows", [("tuned", W, M_VALUES[0]),
                                               ("shipped", 4, 2048)])
def test_the_op_under_auto_is_right_on_every_rank(tuned, source, size, rows):
    """Every emulated rank prepared (EmulatedRanks.prepare: rule 1), then two calls of the
    shape on every rank (the second after the agreement, with new inputs): each right
    against float64 and the same bits on every rank. ``shipped``: no RADIANCE_AR_TUNING,
    W = 4 (the shipped table's rows)."""
    path = tuned if source == "tuned" else ""
    table = tuning.load(path) if path else tuning.shipped()
    for accuracy in ACCURACY_CLASSES:
        ranks = EmulatedRanks(size, DEV)
        rts = [overlap.build(w, auto_settings(path, accuracy)) for w in ranks.worlds]
        calls = [world_jobs.device_shards(seed, size, rows, N, K, DEV) for seed in (5, 6)]
        children = [None] * size

        def prepare(r: int) -> None:
            children[r] = rts[r].auto.prepare(rts[r], *calls[0][r], None, "bf16")

        # rule 1: every rank's child built, grown and its GEMM shapes loaded before any call
        # (not rt.for_call here: its agreement call would park the caller's stream)
        ranks.prepare(prepare)
        want = tuning.choose(table, size, N, rows, "bf16", accuracy)
        assert (children[0].settings.backend, children[0].settings.slices,
                children[0].settings.plan) == (want.backend, want.slices, want.plan)
        for seed, shards in zip((5, 6), calls):
            poison_allocator((rows, N), DEV)
            outs = ranks.each(lambda r: overlap.forward(rts[r], *shards[r], None, "bf16"))
            for child in children:
                child.backend.check(2000.0)
            torch.cuda.synchronize(DEV)
            ref = world_jobs.reference(seed, size, rows, N, K)
            for rank, out in enumerate(outs):
                assert bool(torch.isfinite(out).all()), (accuracy, seed, rank)
                assert world_jobs.rel_rms(out, ref) <= children[0].backend.rel_rms_bound, \
                    (accuracy, seed, rank)
                assert torch.equal(out, outs[0]), (accuracy, seed, rank)
        for rt in rts:
            rt.close()
        # closed runtimes' graph pools stay reserved until emptied; emptied later by the
        # allocator, with a device sync while a peer is parked, they would hang the next
        # calls (tools/emulated_measure.py). No stream waits here.
        torch.cuda.empty_cache()


def test_an_unprepared_emulated_call_raises_before_it_enqueues_anything():
    """Without prepare, rank 0's call refuses (ValueError) instead of parking its stream
    and building a child while its peer may be parked; nothing was enqueued, so the
    device synchronizes at once."""
    ranks = EmulatedRanks(W, DEV)
    rts = [overlap.build(w, auto_settings("", "exact")) for w in ranks.worlds]
    x, w = world_jobs.device_shards(7, W, 2048, N, K, DEV)[0]
    with pytest.raises(ValueError, match="not prepared"):
        with ranks.on(0):
            overlap.forward(rts[0], x, w, None, "bf16")
    torch.cuda.synchronize(DEV)
    for rt in rts:
        rt.close()


def time_auto(path: str, accuracy: str, rows: int) -> tuple[float, float, str, tuple]:
    """(median ms, spread, what replayed, (backend, slices) run) of the op under auto,
    timed as tune times a case: rank 0 active, its peers passive
    (tools/emulated_measure.py)."""
    world = emulated_worlds(W, DEV)[0]
    rt = overlap.build(world, auto_settings(path, accuracy))
    x, w = world_jobs.device_shards(1, W, rows, N, K, DEV)[0]
    child = rt.auto.prepare(rt, x, w, None, "bf16")
    child.backend.fill_passive_peers()
    rt.backend.fill_passive_peers()
    xs = [x] + [x.clone() for _ in range(gpu_timing.copies_for(x) - 1)]

    def op(i):
        overlap.forward(rt, xs[i % len(xs)], w, None, "bf16")

    med, spread, _host = gpu_timing.device_and_host_ms(op, REPS, WARMUP)
    replayed = child.graph_reason() or "replayed"
    ran = (child.backend.name, child.settings.slices)
    rt.close()
    torch.cuda.empty_cache()  # as after every tune case (tools/emulated_measure.py)
    return med, spread, replayed, ran


def test_the_op_under_auto_runs_the_best_measured_row(tuned):
    table = tuning.load(tuned)
    records = []
    for accuracy in ACCURACY_CLASSES:
        classes = ACCURACY_CLASSES[:ACCURACY_CLASSES.index(accuracy) + 1]
        for rows in M_VALUES:
            here = [r for r in table.rows if r.M == rows and r.accuracy in classes]
            best = min(here, key=lambda r: r.t_ms)  # independent of tuning.choose
            base = next(r for r in table.rows if r.M == rows
                        and (r.backend, r.slices) == ("oneshot_wht6", 1))
            c = tuning.choose(table, W, N, rows, "bf16", accuracy)
            assert (c.backend, c.slices, c.plan) == (best.backend, best.slices, best.plan)
            med, spread, replayed, ran = time_auto(tuned, accuracy, rows)
            assert ran == (best.backend, best.slices), (accuracy, rows, ran, best.label())
            records.append({"accuracy": accuracy, "M": rows, "choice": best.label(),
                            "tuned_ms": best.t_ms, "auto_ms": med, "auto_spread_ms": spread,
                            "ratio": med / best.t_ms, "base_ms": base.t_ms,
                            "vs_base": base.t_ms / med, "op_graphs": replayed})
    folder = os.path.dirname(tuned)
    with open(os.path.join(folder, "auto.json"), "w") as f:
        json.dump({"tuning": table.path, "device": table.device, "records": records}, f, indent=1)
    print("\naccuracy   M      choice                          tuned ms  auto ms  ratio  vs base")
    for r in records:
        print(f"{r['accuracy']:<10} {r['M']:<6} {r['choice']:<31} {r['tuned_ms']:8.3f} "
              f"{r['auto_ms']:8.3f} {r['ratio']:6.3f} {r['vs_base']:6.2f}x")
