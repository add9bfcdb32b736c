"""Every knob: defaults parse, every bad value raises naming the variable and the value."""

import pytest

import backends
from backends import envs
from overlap.config import OverlapSettings, from_env

BAD_VALUES = {
    "RADIANCE_AR_OVERLAP": ["2", "yes", "on", " 1x"],
    "RADIANCE_AR_BACKEND": ["", "   ", "nccl", "STOCK"],
    "RADIANCE_AR_OVERLAP_MIN_M": ["0", "-5", "1.5", "abc", ""],
    "RADIANCE_AR_OVERLAP_SLICES": ["0", "-1", "four", "2.0", ""],
    "RADIANCE_AR_ONESHOT_CTAS": ["0", "x", "-3"],
    "RADIANCE_AR_SPIN_TIMEOUT_MS": ["0", "-1", "nan", "inf", "soon"],
    "RADIANCE_AR_SDMA_SCHEDULE": ["", "one-shot", "ring"],
}


def test_every_knob_has_bad_values_listed_here():
    assert set(BAD_VALUES) == set(envs.KNOBS)


def test_defaults():
    s = from_env({})
    assert s == OverlapSettings(enabled=False, backend="stock", min_m=2048, slices=4)
    assert envs.snapshot({})["RADIANCE_AR_SDMA_SCHEDULE"] == "auto"


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
