"""One baseline for every row (tools/baseline.py, compare_backends --baseline)."""

import json

import pytest

import baseline
import compare_backends
from world_measure import Case


def test_an_arm_is_a_registered_backend_and_a_slice_count():
    assert baseline.parse_arm("sdma:4") == ("sdma", 4)
    assert baseline.parse_arm("oneshot_wht6") == ("oneshot_wht6", 1)
    assert baseline.parse_arm("stock:8") == ("stock", 1)  # stock never slices
    for bad, words in (("nccl", "unknown backend"), ("sdma:0", "expected an integer"),
                       ("sdma:x", "expected an integer")):
        with pytest.raises(ValueError, match=words):
            baseline.parse_arm(bad)


def test_defaults_name_the_vendor_collective_or_the_spin_wait_ar():
    assert baseline.default_arm("gpu-emulated")[0] == ("oneshot_wht6", 1)
    assert baseline.default_arm("cpu-shm")[0] == ("stock", 1)
    assert baseline.default_arm("gpu-symm")[0] == ("stock", 1)


def test_the_arm_is_measured_once_at_every_m():
    cases = [Case("sdma", m, 64, 32, s, 1, 0) for m in (64, 128) for s in (1, 4)]
    out = baseline.with_arm(cases, ("stock", 1), "uniform")
    extra = out[len(cases):]
    assert [(c.backend, c.rows, c.slices) for c in extra] == [("stock", 64, 1), ("stock", 128, 1)]
    assert baseline.with_arm(cases, ("sdma", 4), "uniform") == cases  # already there


def test_vs_base_is_the_arms_op_time_over_the_rows_at_the_same_m():
    records = [{"backend": "oneshot_wht6", "slices": 1, "M": 8, "t_ovl_ms": 2.0},
               {"backend": "sdma", "slices": 4, "M": 8, "t_ovl_ms": 1.0},
               {"backend": "sdma", "slices": 4, "M": 16, "t_ovl_ms": 3.0},
               {"backend": "sdma", "slices": 1, "M": 8}]
    baseline.add_vs_base(records, ("oneshot_wht6", 1), "uniform")
    assert [r["vs_base"] for r in records] == [1.0, 2.0, None, None]


def test_a_sliced_arm_is_the_one_of_the_runs_first_plan():
    # --baseline sdma:4 --plans uniform,growing: the base is the uniform arm, whichever
    # record comes last
    records = [{"backend": "sdma", "slices": 4, "plan": "uniform", "M": 8, "t_ovl_ms": 1.0},
               {"backend": "sdma", "slices": 4, "plan": "growing", "M": 8, "t_ovl_ms": 2.0}]
    baseline.add_vs_base(records, ("sdma", 4), "uniform")
    assert [r["vs_base"] for r in records] == [1.0, 0.5]
    cases = [Case("sdma", 8, 64, 32, 4, 1, 0, plan="growing")]
    extra = baseline.with_arm(cases, ("sdma", 4), "uniform")[1:]
    assert [(c.backend, c.slices, c.plan) for c in extra] == [("sdma", 4, "uniform")]


def test_a_cpu_run_measures_the_arm_and_names_it(tmp_path):
    assert compare_backends.main(["--world", "2", "--quick", "--backends", "sdma", "--no-png",
                                  "--out-dir", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert {r["backend"] for r in saved["records"]} == {"sdma", "stock"}
    assert saved["mode"]["vs_base"].startswith("stock unsliced")
    assert all("vs_base" not in r for r in saved["records"])  # CPU: no timings, no ratio


def test_prefill_arms_are_compared_with_the_base_backends_off_arm():
    records = [{"arm": "off", "backend": "oneshot_wht6", "t_prefill_ms": 30.0},
               {"arm": "on", "backend": "oneshot_wht6", "t_prefill_ms": 40.0},
               {"arm": "off", "backend": "sdma_wht6", "t_prefill_ms": 20.0},
               {"arm": "on", "backend": "sdma_wht6", "t_prefill_ms": 15.0},
               {"arm": "on", "backend": "sdma", "t_prefill_ms": None}]
    baseline.add_prefill_vs_base(records, "oneshot_wht6")
    assert [r["vs_base"] for r in records] == [1.0, 0.75, 1.5, 2.0, None]


def test_prefill_bench_measures_the_base_backend_and_checks_the_name():
    import prefill_bench

    args = prefill_bench.parse_args(["--backends", "sdma", "--baseline", "oneshot_wht6"])
    spec = prefill_bench.make_spec(args, "cpu")
    assert spec.backends == ("sdma", "oneshot_wht6")
    assert prefill_bench.base_backend(prefill_bench.parse_args([]), "emulated") == "oneshot_wht6"
    assert prefill_bench.base_backend(prefill_bench.parse_args([]), "cpu") == "stock"
    with pytest.raises(SystemExit):
        prefill_bench.parse_args(["--baseline", "nccl"])
