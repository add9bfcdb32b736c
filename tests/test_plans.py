"""The slicing plans and slice counts in the compare tool: --plans and --slices (with
auto) parsing, one case per plan where the op slices, the labels and file names that tell
the plans apart, and the plot's series."""

from types import SimpleNamespace

import pytest

import compare_backends
import report
import timeline


def test_plans_make_one_case_each_where_the_op_slices():
    args = compare_backends.parse_args(["--backends", "sdma,stock", "--m", "64", "--slices",
                                        "1,4", "--plans", "growing,uniform,growing"])
    assert args.plans == ["growing", "uniform"]  # duplicates dropped, order kept
    got = [(c.backend, c.slices, c.plan, c.label()) for c in compare_backends.cases(args, "cpu")]
    # one slice (and the never-sliced stock) is one plan, recorded as the default
    assert got == [("sdma", 1, "uniform", "sdma M=64 S=1"),
                   ("sdma", 4, "growing", "sdma M=64 S=4 growing"),
                   ("sdma", 4, "uniform", "sdma M=64 S=4"),
                   ("stock", 1, "uniform", "stock M=64 S=1")]


def test_auto_slices_follow_the_rows_and_the_plan_as_the_op_cuts_them():
    # sdma_wht6 at W = 2: uniform slices of about 1024 rows (2 to 8), growing ones 2
    # (SdmaWht6Backend.preferred_slices_for); the op's own bounds agree with each case
    from radiance_ar import backends
    from radiance_ar.overlap.slicing import slice_count
    args = compare_backends.parse_args(["--world", "2", "--backends", "sdma_wht6", "--m",
                                        "2048,3000,4096,8192,16384", "--slices", "auto",
                                        "--plans", "uniform,growing"])
    got = [(c.rows, c.slices, c.plan) for c in compare_backends.cases(args, "cpu")]
    assert got == [(2048, 2, "uniform"), (2048, 2, "growing"), (3000, 2, "uniform"),
                   (3000, 2, "growing"), (4096, 4, "uniform"), (4096, 2, "growing"),
                   (8192, 8, "uniform"), (8192, 2, "growing"), (16384, 8, "uniform"),
                   (16384, 2, "growing")]

    # slice_count asks a backend instance for its world's size
    in_world = SimpleNamespace(world=SimpleNamespace(size=2),
                               preferred_slices_for=backends.get("sdma_wht6").preferred_slices_for)
    assert all(slice_count("auto", in_world, rows, plan) == s for rows, s, plan in got)
    assert slice_count(3, in_world, 8192, "uniform") == 3  # a number wins over auto


@pytest.mark.parametrize("plans,message", [(",", "no plan named"), ("", "no plan named"),
                                           ("uniform,ramp", "'ramp': expected one of")])
def test_bad_plans_stop_the_tool(plans, message, capsys):
    with pytest.raises(SystemExit) as e:
        compare_backends.parse_args(["--plans", plans])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_labels_and_timeline_names_tell_the_plans_apart():
    assert report.slicing({"slices": 4}) == (4, "uniform")
    assert report.slicing_label((4, "uniform")) == "S=4"
    assert report.slicing_label((4, "growing")) == "S=4 growing"
    entry = {"backend": "sdma", "M": 8192, "S": 4}
    assert timeline.png_name(entry) == "timeline_sdma_M8192_S4.png"
    assert timeline.png_name(dict(entry, plan="growing")) == "timeline_sdma_M8192_S4_growing.png"


def test_the_plot_keeps_each_plan_its_own_series(monkeypatch):
    """Two plans of one (backend, S) are two speedup lines and two groups of contention
    bars (one bar per M in each)."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    plotted, bars = [], []
    real_plot, real_bar = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, *a, **k: (plotted.append(k.get("label")),
                                             real_plot(ax, *a, **k))[1])
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda ax, *a, **k: (bars.append((k.get("label"), len(a[0]))),
                                             real_bar(ax, *a, **k))[1])
    records = [{"backend": "sdma", "M": m, "slices": 4, "plan": plan, "speedup": sp,
                "contention": c}
               for m in (8192, 16384)
               for plan, sp, c in (("uniform", 1.08, 1.04), ("growing", 1.12, 1.06))]
    fig = report.figure("t", records)
    assert sorted(plotted) == ["sdma S=4", "sdma S=4 growing"]
    assert sorted(bars) == [("M=16384", 2), ("M=8192", 2)]
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["sdma\nS=4",
                                                                     "sdma\nS=4 growing"]


def test_auto_slices_are_each_backends_own_and_not_measured_twice():
    args = compare_backends.parse_args(["--backends", "sdma,sdma_wht6,stock", "--m", "64",
                                        "--slices", "1,auto,4"])
    assert args.slices == [1, "auto", 4]
    got = [(c.backend, c.slices) for c in compare_backends.cases(args, "cpu")]
    # at the default world size (4) sdma's and sdma_wht6's auto are 2
    # (Backend.preferred_slices_for): each case once
    assert args.world == 4
    assert got == [("sdma", 1), ("sdma", 2), ("sdma", 4), ("sdma_wht6", 1), ("sdma_wht6", 2),
                   ("sdma_wht6", 4), ("stock", 1)]


@pytest.mark.parametrize("slices,message", [(",", "expected integers >= 1 or auto"),
                                            ("auto,0", "expected integers >= 1"),
                                            ("Auto", "comma-separated integers")])
def test_bad_slice_lists_stop_the_tool(slices, message, capsys):
    with pytest.raises(SystemExit) as e:
        compare_backends.parse_args(["--slices", slices])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_shape_options_pass_through_torchrun():
    """torchrun's own parser takes ``--m`` / ``--n`` for abbreviations of its options and
    stops; ``--rows`` / ``--cols`` / ``--inner`` reach the compare tool unchanged."""
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    tool = ["--rows", "1024,8192", "--cols", "5120", "--inner", "4352", "--slices", "1,4"]
    passed = torchrun.parse_args(["--nproc-per-node", "2", "tools/compare_backends.py", *tool])
    assert passed.training_script_args == tool
    args = compare_backends.parse_args(passed.training_script_args)
    assert (args.m, args.n, args.k, args.slices) == ([1024, 8192], 5120, 4352, [1, 4])
    assert compare_backends.parse_args(["--m", "1024,8192"]).m == [1024, 8192]
    with pytest.raises(SystemExit):  # the short spelling does not survive torchrun
        torchrun.parse_args(["--nproc-per-node", "2", "tools/compare_backends.py", "--m", "8"])


def test_the_plot_compares_every_row_with_the_base_arm_where_records_have_it():
    """A third panel: vs_base against M, one line per (backend, slicing), titled with the
    arm; records without vs_base keep two panels."""
    pytest.importorskip("matplotlib")
    records = [{"backend": b, "M": m, "slices": s, "speedup": 1.1, "contention": 1.02,
                "vs_base": v * m / 8192}
               for m in (8192, 16384) for b, s, v in (("sdma", 4, 1.1), ("sdma_wht6", 2, 1.9))]
    fig = report.figure("t", records, base_arm="oneshot_wht6 unsliced (the spin-wait AR)")
    assert len(fig.axes) == 3
    third = fig.axes[2]
    assert "oneshot_wht6 unsliced" in third.get_title()
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in third.get_lines()
             if not ln.get_label().startswith("_")}
    assert lines == {"sdma S=4": [1.1, 2.2], "sdma_wht6 S=2": [1.9, 3.8]}
    assert len(report.figure("t", [{k: v for k, v in r.items() if k != "vs_base"}
                                   for r in records]).axes) == 2
