"""The pure parts of tools/: table/JSON/CSV writing, argument errors, output-path checks and
one quick CPU-world run (the metric formulas: tests/test_metrics.py; the timeline's run:
tests/test_timeline.py)."""

import csv
import json
import math
import os

import pytest
import torch

import compare_backends
import report
import soak


RECORDS = [
    {"backend": "stock", "M": 2048, "slices": 1, "t_gemm_ms": 0.5, "t_ar_ms": 1.5,
     "t_serial_ms": 2.0, "t_ovl_ms": 2.0, "speedup": 1.0, "hidden": 0.0, "contention": None,
     "wire_bytes": 3 * 2 ** 20, "bus_gbs": 2.1, "rel_rms_err": 1e-3, "max_abs_err": 0.1,
     "correct": True},
    {"backend": "sdma", "M": 2048, "slices": 4, "t_gemm_ms": 0.5, "t_ar_ms": 1.5,
     "t_serial_ms": 2.0, "t_ovl_ms": 1.6, "speedup": 1.25, "hidden": 0.8, "contention": 1.02,
     "wire_bytes": 6 * 2 ** 20, "bus_gbs": 4.2, "rel_rms_err": 2e-3, "max_abs_err": 0.2,
     "correct": False, "contention_spread": 0.013, "bound_ms": 1.625, "efficiency": 1.016,
     "slice_overhead_us": 12.5, "link_gbs": 50.0, "link_efficiency": 0.084},
]


def test_table_has_every_column_and_marks_wrong_and_missing():
    text = report.table(RECORDS)
    lines = text.splitlines()
    assert len(lines) == 2 + len(RECORDS)
    for title, _, _ in report.COLUMNS:
        assert title in lines[0]
    assert "WRONG" in lines[3] and "1.25x" in lines[3] and "6.0" in lines[3]
    assert "1.02x±0.01" in lines[3] and "1.625" in lines[3] and "12.5" in lines[3]
    assert "max abs" not in lines[0]  # JSON/CSV only
    assert " - " in lines[2] + " "  # contention None prints as '-'
    host_bound = dict(RECORDS[1], slice_overhead_us=None, slice_overhead_host_bound=True)
    assert " host " in report.table([host_bound]).splitlines()[2]


def test_json_and_csv_round_trip(tmp_path):
    report.write_json(tmp_path / "r.json", {"world": "cpu-shm", "W": 2}, RECORDS)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["mode"]["W"] == 2 and data["records"] == RECORDS
    report.write_csv(tmp_path / "r.csv", RECORDS)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [r["backend"] for r in rows] == ["stock", "sdma"]
    assert rows[1]["speedup"] == "1.25" and rows[0]["contention"] == ""


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    report.write_png(tmp_path / "r.png", "title", RECORDS)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [
    (["--m", "0"], "integers >= 1"),
    (["--m", "abc"], "comma-separated integers"),
    (["--slices", "2,x"], "comma-separated integers"),
    (["--world", "0"], "--world 0"),
    (["--backends", "stock,nope"], "unknown backend 'nope'"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        compare_backends.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cases_cover_backends_rows_and_slices():
    args = compare_backends.parse_args(["--backends", "stock", "--m", "64,128", "--slices", "1,4"])
    cases = compare_backends.cases(args, "cpu")
    # stock is never sliced: one case per M
    assert [(c.backend, c.rows, c.slices) for c in cases] == [("stock", 64, 1), ("stock", 128, 1)]


def test_soak_loop_counts_nan_and_wrong_bits_as_mismatches():
    results = iter([(0.0, True)] * 2 + [(math.nan, True), (0.5, True), (0.0, False), (0.0, True)])
    r = soak.soak_loop(lambda rows: next(results), lambda: (0,), lambda mine: False, 0.1,
                       calls=4, warmup=2, seconds=60.0, max_m=8, seed=0)
    assert r["calls"] == 4 and [m["call"] for m in r["mismatches"]] == [0, 1, 2]
    assert r["memory_after_warmup"] == r["memory_final"] == (0,)


# ----------------------------------------------------------- output paths

def test_unwritable_output_paths_give_rc_2_before_measuring(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for argv, path, reason in (
            (["--out-dir", str(blocker / "sub")], blocker / "sub", "Not a directory"),
            (["--out-dir", str(tmp_path / "out"), "--json", str(tmp_path)], tmp_path,
             "is a directory")):
        # --m 10**9 would take forever to measure: rc 2 proves nothing was measured
        assert compare_backends.main(["--mode", "cpu", "--m", "1000000000"] + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"compare_backends: cannot write {path}: ")
        assert reason in err[0]


def test_writable_output_paths_are_created_and_left_clean(tmp_path):
    out = tmp_path / "new" / "dir"
    assert report.unwritable_reason(str(out), True) is None
    assert report.unwritable_reason(str(tmp_path / "j" / "c.json"), False) is None
    assert out.is_dir() and list(out.iterdir()) == []
    assert list((tmp_path / "j").iterdir()) == []


# ----------------------------------------------------------- the CPU world end to end

def test_cpu_world_run_checks_results_and_reports_no_timings(tmp_path, capsys):
    out = tmp_path / "res"
    rc = compare_backends.main(["--mode", "cpu", "--world", "2", "--quick", "--m", "64",
                                "--backends", "stock,sdma", "--out-dir", str(out), "--no-png",
                                "--timeline"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "--timeline records device events and needs a GPU world; ignored" in text
    assert f"wrote {out / 'compare.json'}, {out / 'compare.csv'}" in text
    records = {r["backend"]: r for r in json.loads((out / "compare.json").read_text())["records"]}
    stock, sdma = records["stock"], records["sdma"]
    for r in (stock, sdma):  # a CPU world: results checked, no timing reads as a result
        assert r["correct"] and r["rel_rms_err"] <= r["rel_rms_bound"] <= 2 ** -6
        assert r["wire_bytes"] > 0
        assert "not a performance measurement" in r["timings"]
        assert not [k for k in r if k.startswith("t_") or k in report.TIMING_KEYS], r
        assert "timeline" not in r and "timeline_events" not in r
    table_head = next(line for line in text.splitlines() if line.strip().startswith("backend"))
    assert "speedup" not in table_head and "rel rms" in table_head
    assert not (out / "timeline.json").exists()


def test_cpu_world_run_with_every_knob_set_in_the_environment(tmp_path, monkeypatch):
    # The gpu-host torchrun compare (RADIANCE_AR_PEER_MEMORY=host) stopped on every rank in
    # reconcile, which the tool's code-given settings go through: a knob the op's settings
    # do not carry. The same path in the CPU world, every knob set (tests/test_config.py).
    from test_config import EVERY_KNOB_SET

    for name, value in EVERY_KNOB_SET.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "res"
    assert compare_backends.main(["--mode", "cpu", "--world", "2", "--quick", "--m", "64",
                                  "--backends", "sdma", "--out-dir", str(out), "--no-png"]) == 0
    records = json.loads((out / "compare.json").read_text())["records"]
    assert "sdma" in [r["backend"] for r in records] and all(r["correct"] for r in records), records


# ----------------------------------------------------------- --producer

def test_producer_choices_are_the_registered_producers(capsys):
    from radiance_ar.overlap import producers

    assert compare_backends.parse_args(["--producer", "mxfp4_w4a8"]).producer == "mxfp4_w4a8"
    with pytest.raises(SystemExit) as e:
        compare_backends.parse_args(["--producer", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err
    assert all(f"'{name}'" in err for name in producers.names())


def test_producer_without_a_weight_format_or_with_timeline_is_refused(monkeypatch, capsys):
    import producer_inputs

    with pytest.raises(SystemExit):
        compare_backends.parse_args(["--producer", "fp8_rowwise", "--timeline"])
    assert "records the bf16 producer only" in capsys.readouterr().err
    monkeypatch.delitem(producer_inputs._WEIGHT_FORMATS, "fp8_rowwise")
    with pytest.raises(SystemExit):
        compare_backends.parse_args(["--producer", "fp8_rowwise"])
    assert "no weight format for it in tools/producer_inputs.py" in capsys.readouterr().err


def test_producer_that_cannot_run_in_a_cpu_world_stops_before_any_rank(tmp_path, capsys):
    # --m 10**9 would take forever to measure: rc 2 proves nothing was measured
    rc = compare_backends.main(["--mode", "cpu", "--m", "1000000000", "--producer",
                                "mxfp4_w4a8", "--out-dir", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--producer mxfp4_w4a8: producer mxfp4_w4a8 cannot run on cpu" in err


def test_quantized_reference_is_the_product_of_the_dequantized_operands():
    import producer_inputs

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    ops = producer_inputs.operands("fp8_rowwise", x, w)
    x_scale = x.double().abs().amax(dim=1, keepdim=True) / 448
    w_scale = w.double().abs().amax(dim=1, keepdim=True) / 448
    x_deq = (x.double() / x_scale).to(torch.float8_e4m3fn).double() * x_scale
    w_deq = ops.weight.double() * w_scale
    torch.testing.assert_close(producer_inputs.reference(ops), x_deq @ w_deq.t(),
                               rtol=1e-6, atol=1e-9)
    assert torch.equal(producer_inputs.reference(producer_inputs.operands("bf16", x, w)),
                       x.double() @ w.double().t())


def test_cpu_world_run_with_a_quantized_producer(tmp_path, capsys):
    out = tmp_path / "res"
    rc = compare_backends.main(["--mode", "cpu", "--world", "2", "--quick", "--m", "64",
                                "--backends", "stock,sdma", "--producer", "fp8_rowwise",
                                "--out-dir", str(out), "--no-png"])
    assert rc == 0, capsys.readouterr()
    doc = json.loads((out / "compare.json").read_text())
    assert doc["mode"]["producer"] == "fp8_rowwise"
    for r in doc["records"]:
        assert r["producer"] == "fp8_rowwise" and r["correct"], r
        assert r["rel_rms_err"] <= 2 ** -6  # the AR's error against the dequantized product


def test_host_world_summary_tables_every_file_and_says_whether_targets_are_met(tmp_path, capsys):
    import host_world_summary as summary

    def write(name, world, w, records):
        path = tmp_path / name
        path.write_text(json.dumps({"mode": {"world": world, "W": w}, "records": records}))
        return str(path)

    met = {"backend": "sdma", "M": 8192, "link_efficiency": 0.9, "contention": 1.03,
           "t_ovl_ms": 2.0, "t_ovl_host_ms": 0.2, "correct": True}
    slow = dict(met, link_efficiency=0.5)
    files = [write("a.json", "gpu-host", 2, [met]), write("b.json", "gpu-host", 4, [slow]),
             write("c.json", "gpu-emulated", 2, [met])]
    assert summary.main(files) == 0  # a missed target is a result, not a failure
    out = capsys.readouterr().out
    assert "target gpu-host W=2 sdma M=8192: link eff 0.90 >= 0.85" in out and ": MET" in out
    assert "target gpu-host W=4 sdma M=8192: link eff 0.50" in out and "MISSED" in out
    assert out.count("target ") == 2 and "gpu-emulated" in out and "200" in out
    wrong = write("d.json", "gpu-host", 2, [dict(met, correct=False)])
    assert summary.main([wrong]) == 1 and "WRONG" in capsys.readouterr().out
    assert summary.main([str(tmp_path / "none.json")]) == 1
    assert "MISSING" in capsys.readouterr().out


def test_resident_memory_is_read_and_graph_costs_refuses_without_a_gpu(tmp_path, capsys):
    from radiance_ar.diagnostics import graph_costs
    from radiance_ar.harness.host import resident_bytes
    statm = tmp_path / "statm"
    statm.write_text("1000 250 30 4 0 300 0\n")
    assert resident_bytes(str(statm)) == 250 * os.sysconf("SC_PAGE_SIZE")
    statm.write_text("garbled\n")
    assert resident_bytes(str(statm)) is None
    assert resident_bytes(str(tmp_path / "missing")) is None
    assert resident_bytes() > 0  # this process, on Linux
    if not torch.cuda.is_available():
        assert graph_costs.main(["--rows", "2048"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--world", "1"], ["--backend", "auto"]])
def test_graph_costs_refuses_worlds_and_backends_without_graphs_of_their_own(argv, capsys):
    from radiance_ar.diagnostics import graph_costs
    with pytest.raises(SystemExit) as stop:
        graph_costs.main(argv)
    assert stop.value.code == 2 and "--world must be >= 2" in capsys.readouterr().err


def test_the_ops_wire_bytes_sum_its_slices_each_under_its_own_schedule():
    """W = 4, 128 x 4096 bf16 (1 MiB): unsliced, sdma's auto takes two-shot (1.5 MiB per
    rank); in 4 slices of 256 KiB each slice takes one-shot (3 MiB in all), which is what the
    transport pulls (a CPU world's pulled_bytes showed both figures)."""
    import types

    from radiance_ar.backends.sdma import SdmaBackend
    from world_measure import Case, op_wire_bytes

    sdma = types.SimpleNamespace(schedule="auto")
    sdma.wire_bytes = types.MethodType(SdmaBackend.wire_bytes, sdma)
    case = Case("sdma", 128, 4096, 64, 4, 1, 0)
    assert sdma.wire_bytes(128 * 4096, 4, 2) == 1_572_864
    assert op_wire_bytes(sdma, case, 4, 4, 2) == 3_145_728
    assert op_wire_bytes(sdma, case, 1, 4, 2) == 1_572_864


def test_every_tool_module_defines_each_top_level_function_once():
    """A second definition silently replaces the first (gpu_timing.median_ms was defined
    twice, so contention_breakdown called the wrong one and crashed)."""
    import ast
    import glob

    here = os.path.dirname(os.path.abspath(__file__))
    paths = glob.glob(os.path.join(here, "..", "tools", "*.py")) + glob.glob(
        os.path.join(here, "..", "radiance_ar", "**", "*.py"), recursive=True)
    twice = []
    for path in paths:
        with open(path) as f:
            names = [n.name for n in ast.parse(f.read()).body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        twice += [f"{os.path.relpath(path, here)}: {n}" for n in set(names) if names.count(n) > 1]
    assert not twice, twice


def test_the_cu_free_check_proves_only_with_every_sm_held(capsys):
    """A transfer that completed while spinners held only some SMs proves nothing, and
    says so; without a GPU the command refuses (exit status 2)."""
    from radiance_ar.diagnostics import cu_free_check as cf

    full = cf.CuFreeResult("H2D copy", True, 5.0, 64 << 20, 132, 132, 2112)
    part = cf.CuFreeResult("H2D copy", True, 5.0, 64 << 20, 132, 120, 1920)
    stuck = cf.CuFreeResult("D2D copy", False, 2000.0, 64 << 20, 132, 132, 2112)
    assert full.proven and "COMPLETED with every SM held" in str(full)
    assert not part.proven and "only 120 of 132 SMs were held: proves nothing" in str(part)
    assert not stuck.proven and "did NOT complete" in str(stuck)
    if not torch.cuda.is_available():
        assert cf.main([]) == 2 and "needs a GPU" in capsys.readouterr().err
