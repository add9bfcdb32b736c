"""The pure parts of tools/: metric formulas, table/JSON/CSV writing, argument errors."""

import csv
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import compare_backends  # noqa: E402
import metrics  # noqa: E402
import report  # noqa: E402
import soak  # noqa: E402


def test_hidden_fraction_endpoints():
    # perfect overlap: the op takes as long as the longer of the two
    assert metrics.hidden_fraction(2.0, 1.0, 2.0) == pytest.approx(1.0)
    # no overlap: the op takes the sum
    assert metrics.hidden_fraction(2.0, 1.0, 3.0) == pytest.approx(0.0)
    # worse than serial
    assert metrics.hidden_fraction(2.0, 1.0, 3.5) == pytest.approx(-0.5)


def test_speedup_contention_bandwidth():
    assert metrics.speedup(3.0, 2.0) == pytest.approx(1.5)
    assert metrics.contention(1.26, 1.0) == pytest.approx(1.26)
    assert metrics.bus_bandwidth_gbs(80 * 2 ** 20, 1.5) == pytest.approx(55.924, rel=1e-4)


def test_errors_against_float64():
    ref = torch.arange(1, 9, dtype=torch.float64).view(2, 4)
    res = ref.clone()
    res[1, 3] += 0.5
    rel, max_abs = metrics.errors(res, ref)
    assert max_abs == pytest.approx(0.5)
    assert rel == pytest.approx(math.sqrt(0.25 / 8) / math.sqrt((ref ** 2).mean().item()))
    work = torch.full_like(ref, float("nan"))
    assert metrics.errors(res.to(torch.bfloat16), ref, work) == metrics.errors(
        res.to(torch.bfloat16), ref)  # the in-place form computes the same numbers
    for bad_work in (work[:1], work.float(), ref):
        with pytest.raises(ValueError, match="work must be a float64 tensor"):
            metrics.errors(res, ref, bad_work)
    assert metrics.errors(torch.zeros(2, 2), torch.zeros(2, 2)) == (0.0, 0.0)
    with pytest.raises(ValueError, match="reference"):
        metrics.errors(torch.zeros(2, 2), torch.zeros(2, 3))


def test_median_and_spread():
    assert metrics.median_and_spread([3.0]) == (3.0, 0.0)
    med, spread = metrics.median_and_spread([1.0, 2.0, 3.0, 4.0, 100.0])
    assert med == 3.0 and 0 < spread < 50
    with pytest.raises(ValueError):
        metrics.median_and_spread([])


RECORDS = [
    {"backend": "stock", "M": 2048, "slices": 1, "t_gemm_ms": 0.5, "t_ar_ms": 1.5,
     "t_serial_ms": 2.0, "t_ovl_ms": 2.0, "speedup": 1.0, "hidden": 0.0, "contention": None,
     "wire_bytes": 3 * 2 ** 20, "bus_gbs": 2.1, "rel_rms_err": 1e-3, "max_abs_err": 0.1,
     "correct": True},
    {"backend": "sdma", "M": 2048, "slices": 4, "t_gemm_ms": 0.5, "t_ar_ms": 1.5,
     "t_serial_ms": 2.0, "t_ovl_ms": 1.6, "speedup": 1.25, "hidden": 0.8, "contention": 1.02,
     "wire_bytes": 6 * 2 ** 20, "bus_gbs": 4.2, "rel_rms_err": 2e-3, "max_abs_err": 0.2,
     "correct": False},
]


def test_table_has_every_column_and_marks_wrong_and_missing():
    text = report.table(RECORDS)
    lines = text.splitlines()
    assert len(lines) == 2 + len(RECORDS)
    for title, _, _ in report.COLUMNS:
        assert title in lines[0]
    assert "WRONG" in lines[3] and "1.25x" in lines[3] and "6.0" in lines[3]
    assert " - " in lines[2] + " "  # contention None prints as '-'


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
