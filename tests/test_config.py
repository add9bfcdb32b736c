"""Every knob: defaults parse, every bad value raises naming the variable and the value."""

import logging
import os
import sys

import pytest

from radiance_ar import backends
from radiance_ar import envs
from radiance_ar.overlap.config import OverlapSettings, from_env, reconcile

BAD_VALUES = {
    "RADIANCE_AR_OVERLAP": ["2", "yes", "on", " 1x"],
    "RADIANCE_AR_BACKEND": ["", "   ", "nccl", "STOCK"],
    "RADIANCE_AR_OVERLAP_MIN_M": ["0", "-5", "1.5", "abc", "", "1_0", "\u0661\u0660"],
    "RADIANCE_AR_OVERLAP_SLICES": ["0", "-1", "four", "2.0", "", "65", "+4", "Auto", "auto4"],
    "RADIANCE_AR_OVERLAP_PLAN": ["", "Uniform", "geometric", "grow"],
    "RADIANCE_AR_ONESHOT_CTAS": ["0", "x", "-3", "1025"],
    "RADIANCE_AR_SDMA_REDUCE_CTAS": ["-1", "1025", "two", "1.0"],
    "RADIANCE_AR_SDMA_CALL_STREAMS": ["0", "3", "two", ""],
    "RADIANCE_AR_SPIN_TIMEOUT_MS": ["0", "-1", "nan", "inf", "soon", "1e300", "1e-9"],
    "RADIANCE_AR_WATCHDOG_S": ["-1", "nan", "inf", "5 min", "1e9"],
    "RADIANCE_AR_SDMA_SCHEDULE": ["", "one-shot", "ring"],
    "RADIANCE_AR_OP_GRAPHS": ["2", "no", "1", "ON"],
    "RADIANCE_AR_OP_GRAPHS_PER_LAYER": ["0", "65", "-1", "many", "4.0"],
    # a path is parsed, then loaded: a file that is missing or not a tuning file stops start-up
    "RADIANCE_AR_TUNING": ["/nonexistent/tuning.json", os.devnull],
    "RADIANCE_AR_ACCURACY": ["", "Exact", "fast", "auto"],
    "RADIANCE_AR_PEER_MEMORY": ["", "Host", "p2p", "shm", "symmetric"],
}


def test_every_knob_has_bad_values_listed_here():
    assert set(BAD_VALUES) == set(envs.KNOBS)


def test_defaults():
    s = from_env({})
    assert s == OverlapSettings(enabled=False, backend="stock", min_m=2048, slices="auto")
    assert envs.snapshot({})["RADIANCE_AR_SDMA_SCHEDULE"] == "auto"
    assert s.plan == "uniform"
    assert from_env({"RADIANCE_AR_OVERLAP_PLAN": "growing"}).plan == "growing"
    with pytest.raises(ValueError, match="plan 'ramp': expected one of uniform, growing"):
        OverlapSettings(True, "stock", 8, 4, plan="ramp")
    with pytest.raises(TypeError, match="backend_settings a BackendSettings"):
        OverlapSettings(True, "stock", 8, 4, "growing")  # the plan is keyword-only
    for slices in ("4", 0, True, 2.0):
        with pytest.raises(ValueError, match="expected an int >= 1 or 'auto'"):
            OverlapSettings(True, "stock", 8, slices)
    assert s.backend_settings == envs.BackendSettings() == envs.BackendSettings(1000.0, "auto", 32)


def test_backend_settings_come_from_the_environment_once():
    env = {"RADIANCE_AR_SPIN_TIMEOUT_MS": "250", "RADIANCE_AR_SDMA_SCHEDULE": " twoshot",
           "RADIANCE_AR_ONESHOT_CTAS": "36"}
    knobs = envs.BackendSettings.from_env(env)
    assert knobs == envs.BackendSettings(spin_timeout_ms=250.0, sdma_schedule="twoshot",
                                         oneshot_ctas=36)
    assert from_env(env).backend_settings == knobs
    assert set(envs.BackendSettings.KNOB_OF.values()) <= set(envs.KNOBS)
    with pytest.raises(ValueError, match="RADIANCE_AR_SDMA_SCHEDULE='ring'"):
        envs.BackendSettings.from_env({"RADIANCE_AR_SDMA_SCHEDULE": "ring"})


#: per field: values the settings' constructor refuses (the knobs' bounds, and wrong types)
BAD_SETTINGS = {
    "spin_timeout_ms": [0, 0.5, 600_000.5, float("nan"), float("inf"), -1, True, "1000", None],
    "sdma_schedule": ["ring", "", " oneshot", None],
    "oneshot_ctas": [0, 1025, -1, 2.0, True, "32", None],
    "sdma_reduce_ctas": [-1, 1025, 2.0, True, "0", None],
    "sdma_call_streams": [0, 3, 1.0, False, "2", None],
    "watchdog_s": [-1, 86_400.5, float("nan"), float("inf"), True, "300", None],
}


def test_every_backend_settings_field_has_bad_values_listed_here():
    assert set(BAD_SETTINGS) == set(envs.BackendSettings.KNOB_OF)


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD_SETTINGS.items() for v in vs])
def test_backend_settings_refuse_what_the_knob_refuses(field, value):
    with pytest.raises(ValueError) as e:
        envs.BackendSettings().replace(**{field: value})
    assert f"{field}={value!r}" in str(e.value)
    assert envs.BackendSettings.KNOB_OF[field] in str(e.value)


def test_backend_settings_take_the_knobs_bounds_and_are_frozen():
    lo = envs.BackendSettings(spin_timeout_ms=1, oneshot_ctas=1, sdma_schedule="oneshot")
    hi = envs.BackendSettings(spin_timeout_ms=600_000, oneshot_ctas=1024)
    assert (lo.spin_timeout_ms, type(lo.spin_timeout_ms), hi.oneshot_ctas) == (1.0, float, 1024)
    with pytest.raises(AttributeError):
        lo.oneshot_ctas = 2


@pytest.mark.parametrize("name,raw", [(n, v) for n, vs in BAD_VALUES.items() for v in vs])
def test_bad_value_names_variable_and_value(name, raw):
    with pytest.raises(ValueError) as e:
        from_env({name: raw})
    assert name in str(e.value) and repr(raw) in str(e.value)


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        from_env({"RADIANCE_AR_BACKEND": "nccl"})
    for name in backends.names():
        assert name in str(e.value)


def test_good_values_parse():
    s = from_env({"RADIANCE_AR_OVERLAP": "1", "RADIANCE_AR_OVERLAP_MIN_M": "1",
                  "RADIANCE_AR_OVERLAP_SLICES": "7"})
    assert (s.enabled, s.min_m, s.slices) == (True, 1, 7)
    assert envs.get("RADIANCE_AR_SPIN_TIMEOUT_MS", {"RADIANCE_AR_SPIN_TIMEOUT_MS": "2.5"}) == 2.5


def test_unknown_knob_is_a_key_error():
    with pytest.raises(KeyError, match="RADIANCE_AR_NOPE"):
        envs.get("RADIANCE_AR_NOPE")


@pytest.mark.parametrize("read", [from_env, envs.given, lambda env: reconcile(CODE, env)])
def test_a_retired_knob_set_stops_start_up_naming_its_replacement(read):
    # RADIANCE_AR_OP_GRAPHS_MAX counted graphs per process; left set, it would be ignored
    with pytest.raises(ValueError, match=r"RADIANCE_AR_OP_GRAPHS_MAX='256': this setting is "
                                         r"retired; use RADIANCE_AR_OP_GRAPHS_PER_LAYER"):
        read({"RADIANCE_AR_OP_GRAPHS_MAX": "256"})
    assert not set(envs.RETIRED_KNOBS) & set(envs.KNOBS)


def test_registry_rejects_duplicate_names():
    with pytest.raises(ValueError, match="already registered"):
        backends.register("stock")(type("Dup", (backends.get("stock"),), {}))


def test_launcher_and_triton_variables():
    assert envs.torchrun_local_rank({}) is None
    assert envs.torchrun_local_rank({"LOCAL_RANK": "3"}) == 3
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        envs.torchrun_local_rank({"LOCAL_RANK": "x"})
    assert envs.triton_interpreter({"TRITON_INTERPRET": "1"})
    assert not envs.triton_interpreter({})


# ---------------------------------------------------------------- bounds and spelling

#: (knob, lowest accepted, highest accepted or None, how the error states the range)
INT_BOUNDS = [
    ("RADIANCE_AR_OVERLAP_MIN_M", 1, None, "an integer >= 1"),
    ("RADIANCE_AR_OVERLAP_SLICES", 1, 64, "auto or an integer in [1, 64]"),
    ("RADIANCE_AR_ONESHOT_CTAS", 1, 1024, "an integer in [1, 1024]"),
    ("RADIANCE_AR_SDMA_REDUCE_CTAS", 0, 1024, "an integer in [0, 1024]"),
]
SPIN = "RADIANCE_AR_SPIN_TIMEOUT_MS"
SPIN_RANGE = "a finite number in [1, 600000]"


def _bound_cases():
    for name, lo, hi, expected in INT_BOUNDS:
        yield name, str(lo - 1), None, expected
        yield name, str(lo), lo, expected
        if hi is None:
            yield name, "1000000000", 1000000000, expected  # no upper bound
        else:
            yield name, str(hi), hi, expected
            yield name, str(hi + 1), None, expected
    for raw, value in [("0.999", None), ("1", 1.0), ("600000", 600000.0),
                       ("600000.001", None), ("1e300", None), ("1e-9", None), ("6e5", 6e5)]:
        yield SPIN, raw, value, SPIN_RANGE


@pytest.mark.parametrize("name,raw,value,expected", list(_bound_cases()))
def test_numeric_knob_bounds_below_above_and_at_both_ends(name, raw, value, expected):
    if value is not None:
        assert envs.get(name, {name: raw}) == value
        return
    with pytest.raises(ValueError) as e:
        envs.get(name, {name: raw})
    assert str(e.value) == f"{name}={raw!r}: expected {expected}" + (
        ", in ASCII digits" if name != SPIN else "")


@pytest.mark.parametrize("name", [n for n, *_ in INT_BOUNDS])
@pytest.mark.parametrize("raw", [
    "1_0",  # int() reads this as 10
    "\u0661\u0660",  # Arabic-Indic "10": int() reads this too
    "\uff13",  # fullwidth 3
    "+3", "3.0", "1e1", "0x10", "1 0",
])
def test_integer_knobs_take_only_ascii_digits(name, raw):
    with pytest.raises(ValueError, match=r"in ASCII digits$") as e:
        envs.get(name, {name: raw})
    assert str(e.value).startswith(f"{name}={raw!r}: expected ") and "an integer" in str(e.value)


@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"),
                    reason="this Python converts digit strings of any length")
def test_an_integer_too_long_to_convert_is_the_knobs_own_error():
    raw = "9" * (sys.get_int_max_str_digits() + 1)
    with pytest.raises(ValueError, match="RADIANCE_AR_OVERLAP_MIN_M='9.*: expected an integer"):
        envs.get("RADIANCE_AR_OVERLAP_MIN_M", {"RADIANCE_AR_OVERLAP_MIN_M": raw})


@pytest.mark.parametrize("raw", ["inf", "-inf", "+inf", "Infinity", "nan", "NaN", "-nan",
                                 "1e309",  # overflows to inf
                                 "1_000", "\u0661\u0660\u0660\u0660"])
def test_spin_timeout_rejects_non_finite_and_odd_spellings(raw):
    with pytest.raises(ValueError) as e:
        envs.get(SPIN, {SPIN: raw})
    assert str(e.value) == f"{SPIN}={raw!r}: expected {SPIN_RANGE}"


#: per knob: (raw text padded with whitespace, value it parses to)
PADDED = {
    "RADIANCE_AR_OVERLAP": [(" 1\n", True), ("\ttrue ", True), (" 0 ", False), ("  ", False)],
    "RADIANCE_AR_BACKEND": [(" stock\t", "stock"), (" auto ", "auto")],
    "RADIANCE_AR_OVERLAP_MIN_M": [("\t16 ", 16)],
    "RADIANCE_AR_OVERLAP_SLICES": [(" 64\n", 64), (" auto ", "auto")],
    "RADIANCE_AR_OVERLAP_PLAN": [(" growing\n", "growing")],
    "RADIANCE_AR_ONESHOT_CTAS": [(" 36 ", 36)],
    "RADIANCE_AR_SDMA_REDUCE_CTAS": [(" 264 ", 264)],
    "RADIANCE_AR_SDMA_CALL_STREAMS": [(" 1\n", 1)],
    "RADIANCE_AR_SPIN_TIMEOUT_MS": [(" 2.5\n", 2.5)],
    "RADIANCE_AR_WATCHDOG_S": [(" 0\n", 0.0), ("\t600 ", 600.0)],
    "RADIANCE_AR_SDMA_SCHEDULE": [(" twoshot ", "twoshot")],
    "RADIANCE_AR_OP_GRAPHS": [(" off ", "off")],
    "RADIANCE_AR_OP_GRAPHS_PER_LAYER": [(" 8\n", 8)],
    "RADIANCE_AR_TUNING": [(" /some/tuning.json\n", "/some/tuning.json"), (" ", "")],
    "RADIANCE_AR_ACCURACY": [(" quantized ", "quantized")],
    "RADIANCE_AR_PEER_MEMORY": [(" host\n", "host"), ("symm ", "symm")],
}


def test_every_knob_kind_is_covered_by_the_whitespace_cases():
    assert set(PADDED) == set(envs.KNOBS)


@pytest.mark.parametrize("name,raw,value", [(n, r, v) for n, cs in PADDED.items() for r, v in cs])
def test_every_knob_strips_whitespace_before_parsing(name, raw, value):
    assert envs.get(name, {name: raw}) == value


def test_an_empty_bool_is_off():
    assert envs.get("RADIANCE_AR_OVERLAP", {"RADIANCE_AR_OVERLAP": ""}) is False


def test_backends_that_wait_on_peers_say_so():
    waiting = [n for n in backends.names() if backends.get(n).waits_on_peers]
    # as a set: registration order follows import order, which other test files change
    assert set(waiting) == {"sdma", "sdma_wht6", "oneshot_wht6"}


def test_the_runtime_hands_its_backend_settings_to_the_backends():
    from radiance_ar import overlap
    from radiance_ar.transport.world import single_world

    knobs = envs.BackendSettings(spin_timeout_ms=300, oneshot_ctas=4)
    rt = overlap.build(single_world(), OverlapSettings(True, "oneshot_wht6", 1, 2, knobs))
    assert rt.backend.settings is knobs and (rt.backend.ctas, rt.backend.timeout_ms) == (4, 300.0)
    assert rt.stock.settings is knobs
    sdma = overlap.build(single_world(), OverlapSettings(True, "sdma_wht6", 1, 2, knobs)).backend
    assert sdma.schedule == knobs.sdma_schedule and sdma.settings.spin_timeout_ms == 300.0


# ---------------------------------------------------------------- one declaration per knob

def test_backend_settings_are_made_from_the_knobs_that_name_a_field():
    declared = [(k.field, k.name, k.default) for k in envs.KNOBS.values() if k.field]
    assert [(f, envs.BackendSettings.KNOB_OF[f], getattr(envs.BackendSettings(), f))
            for f in envs.BackendSettings.KNOB_OF] == declared
    assert envs.BackendSettings.from_env({}) == envs.BackendSettings()
    assert envs.BackendSettings.__module__ == "radiance_ar.envs"  # pickled into CPU-world jobs


@pytest.mark.parametrize("name", list(envs.KNOBS))
def test_a_knobs_default_written_out_parses_to_its_default(name):
    knob = envs.KNOBS[name]
    assert knob.parse(knob.default_text) == knob.default


def test_a_declaration_must_accept_its_own_default():
    with pytest.raises(ValueError, match="knob RADIANCE_AR_X: default 0: expected an integer >= 1"):
        envs.Knob("RADIANCE_AR_X", int, 0, "doc", lo=1)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_START, TABLE_END = "<!-- settings-table -->", "<!-- /settings-table -->"


def test_settings_table_has_one_row_per_knob_with_its_default_and_bounds():
    rows = envs.settings_table().splitlines()
    assert rows[:2] == ["| variable | default | meaning |", "|---|---|---|"]
    assert [r.split(" | ")[0] for r in rows[2:]] == [f"| `{n}`" for n in envs.KNOBS]
    assert "| `RADIANCE_AR_SPIN_TIMEOUT_MS` | `1000` |" in envs.settings_table()
    assert "an integer in [1, 64]" in rows[2 + list(envs.KNOBS).index("RADIANCE_AR_OVERLAP_SLICES")]
    assert all(r.count("|") == 4 for r in rows)  # no doc text breaks a table cell


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_the_docs_hold_the_generated_settings_table(doc):
    with open(os.path.join(ROOT, doc)) as f:
        lines = f.read().splitlines()
    assert lines.count(TABLE_START) == 1 and lines.count(TABLE_END) == 1, doc
    held = "\n".join(lines[lines.index(TABLE_START) + 1:lines.index(TABLE_END)]).strip("\n")
    assert held + "\n" == envs.settings_table(), (
        f"{doc}: the table between {TABLE_START} and {TABLE_END} is not envs.settings_table(); "
        "paste its output there")


# ---------------------------------------------------------------- code vs environment

@pytest.fixture
def warnings_of_reconcile(caplog, monkeypatch):
    """The warnings reconcile logs, with its memory of what it reported emptied."""
    from radiance_ar.overlap import config
    monkeypatch.setattr(config, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="radiance_ar"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "radiance_ar"]


CODE = OverlapSettings(True, "stock", 16, 4, envs.BackendSettings(spin_timeout_ms=300))


def test_settings_given_in_code_win_over_the_environment(warnings_of_reconcile):
    env = {"RADIANCE_AR_BACKEND": "sdma", "RADIANCE_AR_SPIN_TIMEOUT_MS": "300",
           "RADIANCE_AR_OVERLAP_SLICES": "auto"}
    assert reconcile(CODE, env) is CODE
    assert warnings_of_reconcile() == [
        "RADIANCE_AR_BACKEND='sdma' in the environment differs from the settings given in "
        "code (backend='stock'); the code's value is used",
        "RADIANCE_AR_OVERLAP_SLICES='auto' in the environment differs from the settings given "
        "in code (slices=4); the code's value is used",
    ]  # the spin timeout is the code's value: nothing to say


def test_a_difference_is_reported_once(warnings_of_reconcile):
    env = {"RADIANCE_AR_SDMA_SCHEDULE": "twoshot"}
    for _ in range(3):
        reconcile(CODE, env)
    assert warnings_of_reconcile() == [
        "RADIANCE_AR_SDMA_SCHEDULE='twoshot' in the environment differs from the settings "
        "given in code (backend_settings.sdma_schedule='auto'); the code's value is used"]


def test_an_unset_or_equal_environment_says_nothing(warnings_of_reconcile):
    assert reconcile(CODE, {}) is CODE
    reconcile(OverlapSettings(True, "r4d", 16, 4), {"RADIANCE_AR_BACKEND": " oneshot_wht6",
                                                    "RADIANCE_AR_OVERLAP": "true",
                                                    "RADIANCE_AR_OVERLAP_MIN_M": "16"})
    assert warnings_of_reconcile() == []


@pytest.mark.parametrize("name,raw", [(n, v) for n, vs in BAD_VALUES.items() for v in vs])
def test_a_bad_environment_value_stops_code_settings_too(name, raw):
    with pytest.raises(ValueError) as e:
        reconcile(CODE, {name: raw})
    assert name in str(e.value) and repr(raw) in str(e.value)


def test_reconcile_takes_overlap_settings():
    with pytest.raises(TypeError, match="settings must be an OverlapSettings, got BackendSettings"):
        reconcile(envs.BackendSettings(), {})


#: a valid value of every knob, each other than its default where one exists (the tuning
#: file: empty, the shipped table, since a path must load)
EVERY_KNOB_SET = {
    "RADIANCE_AR_OVERLAP": "1", "RADIANCE_AR_BACKEND": "sdma", "RADIANCE_AR_TUNING": "",
    "RADIANCE_AR_ACCURACY": "quantized", "RADIANCE_AR_OVERLAP_MIN_M": "64",
    "RADIANCE_AR_OVERLAP_SLICES": "8", "RADIANCE_AR_OVERLAP_PLAN": "growing",
    "RADIANCE_AR_OP_GRAPHS": "off", "RADIANCE_AR_OP_GRAPHS_PER_LAYER": "8",
    "RADIANCE_AR_PEER_MEMORY": "host", "RADIANCE_AR_SPIN_TIMEOUT_MS": "250",
    "RADIANCE_AR_WATCHDOG_S": "300", "RADIANCE_AR_SDMA_SCHEDULE": "twoshot", "RADIANCE_AR_ONESHOT_CTAS": "36",
    "RADIANCE_AR_SDMA_REDUCE_CTAS": "64", "RADIANCE_AR_SDMA_CALL_STREAMS": "1",
}


def test_reconcile_takes_every_knob_set_in_the_environment(warnings_of_reconcile):
    # the torchrun compare of the gpu-host world (RADIANCE_AR_PEER_MEMORY=host) stopped on
    # every rank with KeyError in reconcile: a knob the op's settings do not carry
    assert set(EVERY_KNOB_SET) == set(envs.KNOBS)
    assert reconcile(CODE, EVERY_KNOB_SET) is CODE
    reported = warnings_of_reconcile()
    assert not any("RADIANCE_AR_PEER_MEMORY" in w for w in reported), reported
    # every op and backend knob but two differs from CODE's value (CODE is enabled and
    # uses the shipped tuning table)
    same = {"RADIANCE_AR_OVERLAP", "RADIANCE_AR_TUNING", "RADIANCE_AR_PEER_MEMORY"}
    assert sorted(w.split("=")[0] for w in reported) == sorted(set(envs.KNOBS) - same)


def test_a_retired_knob_left_empty_is_not_set():
    # an empty value sets nothing to be ignored (as ``VAR=`` turns a boolean knob off)
    assert envs.given({"RADIANCE_AR_OP_GRAPHS_MAX": " "}) == {}
