"""What the measuring tools tell the person running them: every option's default in
--help, a notice before earlier results are overwritten, and CPU-run plots that show
what a CPU run measures (accuracy, wire bytes) instead of empty timing panels."""

import re

import pytest

import compare_backends
import prefill_bench
import prefill_report
import report


def option_helps(text: str) -> dict[str, str]:
    """--help's options (their first flag) -> their help text, lines joined."""
    body = text.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + body)[1:]
    return {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries}


def test_every_compare_option_shows_its_default(capsys):
    with pytest.raises(SystemExit):
        compare_backends.parse_args(["--help"])
    helps = option_helps(capsys.readouterr().out)
    assert {"--n", "--k", "--reps", "--warmup", "--slices", "--m"} <= set(helps)
    for name, text in helps.items():
        assert name == "-h" or "default" in text, text
    assert "default 1024 on the CPU, 5120 on GPUs" in helps["--n"]
    assert "default 5 on the CPU, 30 on GPUs" in helps["--reps"]
    assert helps["--slices"].endswith("default auto")


def test_compare_slices_default_to_auto_what_the_op_runs():
    args = compare_backends.parse_args([])
    assert args.slices == ["auto"] and args.probe_ctas == [8, 16, 32, 64]
    args = compare_backends.parse_args(["--backends", "sdma"])
    cases = compare_backends.cases(args, "cpu")
    from radiance_ar import backends
    assert [c.rows for c in cases] == [256, 1024]  # the CPU default M
    assert all(c.slices == backends.get("sdma").preferred_slices_for(args.world, c.rows, c.plan)
               for c in cases)


# ------------------------------------------------------------------ overwriting

def test_overwrite_notice_names_the_folder_and_the_files_there(tmp_path):
    out = tmp_path / "odd [name]"  # glob characters in the folder: escaped, not patterns
    out.mkdir()
    assert report.overwrite_notice([str(out / "compare.json")]) is None
    for name in ("compare.json", "timeline_sdma_M64_S4.png", "other.txt"):
        (out / name).write_text("")
    folder = report.glob.escape(str(out))
    notice = report.overwrite_notice([folder + "/compare.json", folder + "/compare.csv",
                                      folder + "/timeline_*.png"])
    assert notice == (f"overwriting earlier results in {out}: compare.json, "
                      "timeline_sdma_M64_S4.png")


CPU_HDR = {"world": "cpu-shm", "label": "CPU, 2 processes", "W": 2, "device": "x86_64",
           "date": "today"}


def test_compare_says_it_overwrites_earlier_results(tmp_path, monkeypatch, capsys):
    out = tmp_path / "res"
    monkeypatch.setattr(compare_backends, "run_cpu", lambda args: (dict(CPU_HDR), []))
    argv = ["--mode", "cpu", "--out-dir", str(out), "--no-png"]
    assert compare_backends.main(argv) == 0
    assert "overwriting" not in capsys.readouterr().out  # a new folder
    assert compare_backends.main(argv) == 0
    text = capsys.readouterr().out
    assert f"overwriting earlier results in {out}: compare.json, compare.csv\n" in text
    assert text.index("overwriting") < text.index("wrote")  # said before, not after


def test_prefill_bench_says_it_overwrites_earlier_results(tmp_path, monkeypatch, capsys):
    out = tmp_path / "res"
    out.mkdir()
    (out / "prefill.csv").write_text("")
    monkeypatch.setattr(prefill_bench, "run_cpu", lambda args, spec: (
        dict(CPU_HDR, model={"name": "tiny"}), []))
    monkeypatch.setattr(prefill_report, "summary", lambda hdr, records: "")
    assert prefill_bench.main(["--mode", "cpu", "--out-dir", str(out), "--no-png"]) == 0
    assert f"overwriting earlier results in {out}: prefill.csv\n" in capsys.readouterr().out


# ------------------------------------------------------------------ CPU plots

def cpu_compare_records():
    rec = {"world": "cpu-shm", "M": 64, "plan": "uniform", "correct": True}
    records = [dict(rec, backend="stock", slices=1, rel_rms_err=2e-3, rel_rms_bound=2 ** -6,
                    wire_bytes=2 ** 20, t_ovl_ms=3.0),
               dict(rec, backend="sdma", slices=4, rel_rms_err=2e-3, rel_rms_bound=2 ** -8,
                    wire_bytes=2 ** 21, t_ovl_ms=2.0),
               dict(rec, backend="sdma", slices=4, M=128, rel_rms_err=1e-3,
                    rel_rms_bound=2 ** -8, wire_bytes=2 ** 22)]
    return [report.without_timings(r) for r in records]


def bar_heights(ax) -> list[float]:
    return [round(p.get_height(), 6) for p in ax.patches]


def test_a_cpu_compare_plot_shows_accuracy_and_wire_bytes():
    pytest.importorskip("matplotlib")
    fig = report.figure("CPU, 2 processes", cpu_compare_records())
    title = fig.get_suptitle()
    assert "CPU run: timings were not measured" in title and "accuracy and wire bytes" in title
    accuracy, wire = fig.axes
    assert "accuracy" in accuracy.get_title() and wire.get_title() == "wire bytes"
    # bars by M (64, then 128), each the error as a share of its backend's bound
    assert bar_heights(accuracy) == [round(2e-3 / 2 ** -6, 6), round(2e-3 / 2 ** -8, 6),
                                     round(1e-3 / 2 ** -8, 6)]
    assert bar_heights(wire) == [1.0, 2.0, 4.0]
    assert [t.get_text() for t in accuracy.get_xticklabels()] == ["stock\nS=1", "sdma\nS=4"]
    texts = " ".join(t.get_text() for t in accuracy.texts)
    assert "2.0e-03" in texts and "1.0e-03" in texts  # the errors themselves, on the bars


def test_a_gpu_compare_plot_still_shows_speedup_and_contention():
    pytest.importorskip("matplotlib")
    records = [{"backend": "sdma", "M": 2048, "slices": 4, "speedup": 1.2, "contention": 1.02}]
    speed, cont = report.figure("GPU", records).axes
    assert speed.get_title().startswith("speedup") and cont.get_title() == "contention"


def test_a_cpu_prefill_plot_shows_the_errors_and_the_real_chunks():
    pytest.importorskip("matplotlib")
    hdr = dict(CPU_HDR, model={"name": "tiny"}, tp=2, layers=4, tokens=160, chunk=64,
               chunk_rows=[64, 64, 32])
    base = {"identical_on_ranks": True, "finite": True, "correct": True, "slices": 4}
    records = [dict(base, arm="off", backend="stock", call_rel_rms_max=1e-3, call_bound=2e-3,
                    stack_rel_rms_vs_off=None, stack_bound=0.05),
               dict(base, arm="on", backend="sdma", call_rel_rms_max=1e-3, call_bound=4e-3,
                    stack_rel_rms_vs_off=0.01, stack_bound=0.02),
               {"arm": "on", "backend": "symm_oneshot", "skipped": "no GPU", "correct": None}]
    fig = prefill_report.figure(hdr, records)
    title = fig.get_suptitle()
    assert "160 tokens in chunks [64, 64, 32]" in title and "chunks of" not in title
    assert "CPU run: timings were not measured" in title
    calls, stack = fig.axes
    assert bar_heights(calls) == [0.5, 0.25] and bar_heights(stack) == [0.5]
