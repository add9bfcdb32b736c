"""tools/tune.py: a CPU world's tune run writes a tuning file that loads, says its times
mean nothing, and holds every checked case; the shipped table is what --from-compare
makes of the committed H200 runs."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shlex
import subprocess
import sys

import pytest

from radiance_ar.overlap import tuning

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def tune(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("RADIANCE_AR_BACKEND", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "tune.py"), *argv],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_a_cpu_tune_run_writes_every_checked_case_and_says_the_times_mean_nothing(tmp_path):
    out = str(tmp_path / "t.json")
    r = tune("--world", "2", "--m", "64,128", "--n", "256", "--k", "64", "--backends",
             "sdma,sdma_wht6", "--slices", "1,2", "--reps", "2", "--warmup", "1", "--out", out)
    assert r.returncode == 0, r.stderr
    t = tuning.load(out)
    assert t.world == "cpu-shm" and "the times mean nothing" in t.note
    # sdma: 2 M x (S=1, S=2 uniform, S=2 growing); sdma_wht6 the same; the base arm (stock) per M
    cases = {(row.backend, row.M, row.slices, row.plan) for row in t.rows}
    want = {(b, m, s, p) for b in ("sdma", "sdma_wht6") for m in (64, 128)
            for s, p in ((1, "uniform"), (2, "uniform"), (2, "growing"))}
    assert cases == want | {("stock", 64, 1, "uniform"), ("stock", 128, 1, "uniform")}
    assert all(row.W == 2 and row.N == 256 and row.K == 64 and row.t_ms > 0 for row in t.rows)
    assert "ETA" in r.stderr and "1/14" in r.stderr
    summary = r.stdout.splitlines()
    assert summary[0].startswith("# 14 of 14 cases measured in ")
    assert summary[1] == f"# tuning file {out}: cpu, cpu-shm, {t.measured_at}"
    for m in (64, 128):
        best = min((row for row in t.rows if row.M == m and row.backend != "sdma_wht6"),
                   key=lambda row: row.t_ms)
        line = next(x for x in summary if x.split()[:3] == ["2", "256", str(m)])
        assert f"{best.t_ms:.3f}" in line, (line, best)


def test_a_budget_of_no_time_measures_nothing_and_writes_no_file(tmp_path):
    out = str(tmp_path / "t.json")
    r = tune("--world", "2", "--m", "64", "--n", "256", "--k", "64", "--backends", "sdma",
             "--slices", "1", "--max-minutes", "0", "--out", out)
    assert r.returncode == 1 and "--max-minutes 0 reached after 0 of" in r.stderr
    assert not os.path.exists(out)


def test_the_shipped_table_is_reproduced_by_the_committed_results(tmp_path):
    """Converted from compare runs: converting them again gives the same table. Written
    by a tune run: its file is committed under tools/results/ (the same bytes)."""
    with open(tuning.SHIPPED_PATH, "rb") as f:
        data = f.read()
    shipped = json.loads(data)
    argv = shlex.split(shipped["command"])[1:]
    if "--from-compare" not in argv:
        committed = glob.glob(os.path.join(ROOT, "tools", "results", "**", "*.json"),
                              recursive=True)
        assert any(open(p, "rb").read() == data for p in committed), \
            "the shipped tuning table is not committed under tools/results/"
        return
    out = str(tmp_path / "t.json")
    argv[argv.index("--out") + 1] = out
    r = tune(*argv)
    assert r.returncode == 0, r.stderr
    again = json.load(open(out))
    assert {k: v for k, v in again.items() if k != "command"} == \
        {k: v for k, v in shipped.items() if k != "command"}


def test_resume_keeps_the_rows_a_run_wrote_and_measures_only_the_rest(tmp_path):
    """A run cut short (here: one M) and resumed with more M values: the first run's rows
    are kept as they were, and only the cases the file lacks are measured."""
    out = str(tmp_path / "t.json")
    common = ("--world", "2", "--n", "256", "--k", "64", "--backends", "sdma", "--slices", "1",
              "--reps", "2", "--warmup", "1", "--out", out)
    assert tune("--m", "64", *common).returncode == 0
    first = json.load(open(out))["rows"]
    r = tune("--m", "64,128", "--resume", *common)
    assert r.returncode == 0, r.stderr
    assert "--resume: 2 rows kept" in r.stderr and "2 cases left" in r.stderr
    t = json.load(open(out))
    assert t["rows"][:2] == first and "2 rows kept from an earlier run" in t["note"]
    assert sorted((x["backend"], x["M"]) for x in t["rows"]) == \
        [("sdma", 64), ("sdma", 128), ("stock", 64), ("stock", 128)]


def test_the_markdown_summary_is_the_choice_of_each_class_against_the_base():
    """--summary FILE --markdown: the README's table, one line per tuned shape, each cell
    what tuning.choose says, under the file's device, runtime, date and command."""
    r = tune("--summary", tuning.SHIPPED_PATH, "--markdown")
    assert r.returncode == 0, r.stderr
    t = tuning.shipped()
    lines = r.stdout.splitlines()
    assert lines[0] == (f"Measured on {t.device} ({t.world}; {t.runtime}) at {t.measured_at}: "
                        f"`{t.command}`")
    body = [x for x in lines if x.startswith("| ") and not x.startswith("| W ")]
    shapes = sorted({(x.W, x.N, x.M) for x in t.rows})
    assert len(body) == len(shapes)
    for line, (W, N, M) in zip(body, shapes):
        cells = [c.strip() for c in line.strip("|").split("|")]
        ex, q = (tuning.choose(t, W, N, M, "bf16", a) for a in ("exact", "quantized"))
        assert cells == [str(W), str(N), str(M), "bf16", ex.label(), f"{ex.t_ms:.3f}",
                         f"{ex.base_ms / ex.t_ms:.2f}x", q.label(), f"{q.t_ms:.3f}",
                         f"{q.base_ms / q.t_ms:.2f}x", ex.base, f"{ex.base_ms:.3f}"]


def test_a_case_over_the_case_timeout_exits_3_naming_it():
    """The watchdog of a case that never returns (a hung emulated case): exit 3 with the
    case named, from whatever the main thread is stuck in."""
    code = ("import time, tune; tune.case_watchdog(0.2, 'sdma_wht6 M=4096 S=2 growing W=4', "
            "'t.json'); time.sleep(30)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tools")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 3, r.stderr
    assert "sdma_wht6 M=4096 S=2 growing W=4 still running after --case-timeout 0.2 s" in r.stderr


def test_a_run_stopped_in_a_case_leaves_a_file_naming_it(tmp_path):
    """A CPU case over --case-timeout raises in the pool: the run stops with exit 3 (a file
    cut short, as a GPU hang), its file holding what was measured before the case and naming
    it, and stderr naming the pool's error."""
    out = str(tmp_path / "t.json")
    common = ("--world", "2", "--n", "256", "--k", "64", "--backends", "sdma", "--slices", "1",
              "--reps", "2", "--warmup", "1", "--out", out)
    assert tune("--m", "64", *common).returncode == 0
    r = tune("--m", "64,128", "--resume", "--case-timeout", "0.001", *common)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and "no result from every rank within 0.001 s" in r.stderr
    t = tuning.load(out)
    assert len(t.rows) == 2 and "INCOMPLETE: case 1 of 2 (sdma M=128" in t.note, t.note
    assert "failed: run_case: no result from every rank" in t.note


def test_a_run_cut_short_says_incomplete_in_its_file_and_exits_3(tmp_path):
    """--max-minutes reached after some cases: the file holds them, its note says
    INCOMPLETE (a table cut short must not read as a whole one), and the exit code is 3."""
    out = str(tmp_path / "t.json")
    r = tune("--world", "2", "--m", "64,128", "--n", "256", "--k", "64", "--backends", "sdma",
             "--slices", "1", "--reps", "2", "--warmup", "1", "--max-minutes", "0.001",
             "--out", out)
    assert r.returncode == 3, r.stderr
    t = tuning.load(out)
    assert "INCOMPLETE: --max-minutes 0.001 reached after 1 of 4 cases" in t.note
    assert len(t.rows) == 1


def test_a_resume_refuses_another_machines_file_and_bad_compare_files(tmp_path):
    out = str(tmp_path / "t.json")
    tuning.dump(out, {"device": "NVIDIA H200", "runtime": "torch 2.11.0+cu130, cuda 13.0, hip None",
                      "world": "gpu-emulated", "measured_at": "2026-12-04T12:42:00",
                      "command": "tune.py --worlds 2", "note": ""},
                [{"backend": "sdma", "schedule": "oneshot", "W": 2, "N": 256, "K": 4352, "M": 64,
                  "producer": "bf16", "slices": 1, "plan": "uniform", "t_ms": 1.0,
                  "spread_ms": 0.0, "correct": True}])
    before = open(out).read()
    r = tune("--world", "2", "--m", "64", "--n", "256", "--k", "64", "--backends", "sdma",
             "--slices", "1", "--resume", "--out", out)
    assert r.returncode == 2 and "measured on {'device': 'NVIDIA H200'" in r.stderr, r.stderr
    assert open(out).read() == before
    r = tune("--from-compare", str(tmp_path / "none.json"), "--out", out)
    assert r.returncode == 2 and "none.json: not a compare_backends JSON file" in r.stderr
    cpu = tmp_path / "cpu.json"  # a CPU run's records carry no times
    cpu.write_text(json.dumps({"mode": {"device": "cpu", "world": "cpu-shm", "date": "d",
                                        "command": "c"},
                               "records": [{"backend": "sdma", "correct": True}]}))
    r = tune("--from-compare", str(cpu), "--out", out)
    assert r.returncode == 2 and "no correct, timed case" in r.stderr
    assert open(out).read() == before


def test_a_producer_this_device_cannot_run_stops_the_tune_before_any_case(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU runs the MXFP4 producer")
    out = str(tmp_path / "t.json")
    r = tune("--world", "2", "--m", "64", "--n", "256", "--k", "64", "--backends", "sdma",
             "--slices", "1", "--producers", "bf16,mxfp4_w4a8", "--out", out)
    assert r.returncode == 2, r.stderr  # the CPU runs MXFP4 only under Triton's interpreter
    assert "tune: --producers mxfp4_w4a8: producer mxfp4_w4a8 cannot run on cpu" in r.stderr
    assert "ETA" not in r.stderr and not os.path.exists(out)


def test_backend_knobs_set_away_from_their_defaults_are_in_the_note():
    import tune as tune_module
    from radiance_ar.envs import BackendSettings

    hdr = {"torch": "2.13", "cuda": None, "hip": None, "world": "gpu-emulated", "device": "d",
           "date": "t", "backend_settings": dataclasses.asdict(
               BackendSettings(sdma_schedule="twoshot"))}
    head = tune_module.header_of(hdr, "tune.py", "my note")
    assert head["note"] == "backend knobs: sdma_schedule=twoshot. my note"
    assert head["sdma_schedule"] == "twoshot"  # structured too: auto checks it
    hdr["backend_settings"] = dataclasses.asdict(BackendSettings())
    assert tune_module.header_of(hdr, "tune.py", "")["note"] == ""
    assert tune_module.header_of(hdr, "tune.py", "")["sdma_schedule"] == "auto"
