"""The vLLM plugin (radiance_ar.overlap.vllm_plugin): the compile-cache key, the knobs checked
at registration, and the hook that installs the op when vLLM loads a model; on stand-ins
always, the cache key also against a real vLLM where installed (``.ci/run``'s vLLM venv)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest

from radiance_ar import backends
from radiance_ar.overlap import vllm_plugin as vp
from radiance_ar.overlap.config import OverlapSettings

OFF = OverlapSettings(False, "stock", 2048, 4)


def _vllm_like_envs():
    """A module shaped like vllm.envs: compile_factors() calls every registered getter."""
    env = types.SimpleNamespace(environment_variables={"VLLM_X": lambda: "1"})
    env.compile_factors = lambda: {k: g() for k, g in env.environment_variables.items()}
    return env


def test_the_flag_and_backend_reach_a_vllm_style_compile_cache_key(monkeypatch):
    env = _vllm_like_envs()
    assert vp.add_compile_cache_factors(env) and vp.add_compile_cache_factors(env)
    assert sorted(env.environment_variables) == sorted([*vp.COMPILE_CACHE_KNOBS, "VLLM_X"])

    def key(overlap_flag, backend="stock"):
        monkeypatch.setenv("RADIANCE_AR_OVERLAP", overlap_flag)
        monkeypatch.setenv("RADIANCE_AR_BACKEND", backend)
        return repr(sorted(env.compile_factors().items()))

    assert key("1") != key("0")
    for other in [n for n in backends.names() if n != "stock"][:1]:
        assert key("1") != key("1", other)
        assert key("0") == key("0", other)  # flag off: the graph has no op, backend unkeyed
    assert vp.compile_cache_factors(OFF) == {"RADIANCE_AR_OVERLAP": False,
                                             "RADIANCE_AR_BACKEND": None,
                                             "RADIANCE_AR_ACCURACY": None,
                                             "RADIANCE_AR_TUNING": None}
    # auto: which layers stay stock follows the accuracy and the table's rows
    monkeypatch.setenv("RADIANCE_AR_ACCURACY", "quantized")
    assert key("1", "auto") != key("1")
    exact = key("1", "auto")
    monkeypatch.setenv("RADIANCE_AR_ACCURACY", "exact")
    assert key("1", "auto") != exact
    assert key("0", "auto") == key("0")  # flag off: nothing of auto is keyed


def test_a_vllm_without_env_factors_gets_a_warning_how_to_key_the_cache(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.radiance_ar"):
        assert vp.add_compile_cache_factors(types.SimpleNamespace()) is False
    assert "VLLM_CACHE_ROOT" in caplog.text and "cache_dir" in caplog.text


def test_register_stops_on_a_bad_knob(monkeypatch):
    monkeypatch.setenv("RADIANCE_AR_OVERLAP_SLICES", "zero")
    with pytest.raises(ValueError, match="RADIANCE_AR_OVERLAP_SLICES='zero'"):
        vp.register()


def test_patch_loaders_wraps_every_own_load_model_once(monkeypatch):
    installed = []
    monkeypatch.setattr(vp, "install", lambda model, vllm_config=None:
                        installed.append((model, vllm_config)))

    class BaseModelLoader:
        def load_model(self, vllm_config, model_config, prefix=""):
            return f"model:{model_config}"

    class Inherits(BaseModelLoader):
        pass

    class Overrides(BaseModelLoader):
        def load_model(self, vllm_config, model_config, prefix=""):
            return super().load_model(vllm_config, model_config, prefix) + "+own"

    module = types.SimpleNamespace(BaseModelLoader=BaseModelLoader,
                                   _LOAD_FORMAT_TO_MODEL_LOADER={"auto": Inherits})
    assert vp.patch_loaders(module) == 2
    assert vp.patch_loaders(module) == 0
    assert Inherits().load_model("cfg", "a") == "model:a"
    assert installed == [("model:a", "cfg")]
    installed.clear()
    assert Overrides().load_model(vllm_config="cfg", model_config="b") == "model:b+own"
    # the inner (base) load and the outer one both install; install is idempotent
    assert installed == [("model:b", "cfg"), ("model:b+own", "cfg")]


def test_after_import_hook_runs_after_the_module_and_then_leaves(tmp_path, monkeypatch):
    pkg = tmp_path / "radiance_fake_loader"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    seen = []
    hook = vp.AfterImport("radiance_fake_loader", lambda mod: seen.append(mod.VALUE + 1))
    sys.meta_path.insert(0, hook)
    import radiance_fake_loader  # noqa: F401

    monkeypatch.delitem(sys.modules, "radiance_fake_loader")
    assert seen == [42] and hook not in sys.meta_path
    assert radiance_fake_loader.__spec__.name == "radiance_fake_loader"


def test_hook_model_loading_waits_for_vllm_to_import_its_loaders(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, vp.LOADER_PACKAGE, raising=False)
    vp.hook_model_loading()
    vp.hook_model_loading()
    hooks = [f for f in sys.meta_path if isinstance(f, vp.AfterImport)]
    assert len(hooks) == 1 and hooks[0].fullname == vp.LOADER_PACKAGE
    assert sys.meta_path[0] is hooks[0]


def test_real_vllm_compile_factors_carry_the_flag(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.envs as venvs
    from vllm.config.utils import hash_factors

    monkeypatch.setattr(venvs, "environment_variables", dict(venvs.environment_variables))
    assert vp.add_compile_cache_factors()
    monkeypatch.setenv("RADIANCE_AR_OVERLAP", "0")
    off = venvs.compile_factors()
    monkeypatch.setenv("RADIANCE_AR_OVERLAP", "1")
    monkeypatch.setenv("RADIANCE_AR_BACKEND", "stock")
    on = venvs.compile_factors()
    assert (off["RADIANCE_AR_OVERLAP"], on["RADIANCE_AR_OVERLAP"]) == (False, True)
    assert on["RADIANCE_AR_BACKEND"] == "stock"
    assert hash_factors(off) != hash_factors(on)


def test_under_auto_another_tuning_table_is_another_compile_cache_key(tmp_path):
    from radiance_ar.overlap import tuning

    other = tmp_path / "tuning_here.json"
    other.write_text(open(tuning.SHIPPED_PATH).read() + "\n")  # same rows, other bytes
    auto = OverlapSettings(True, "auto", 2048, "auto")
    shipped = vp.compile_cache_factors(auto)
    here = vp.compile_cache_factors(dataclasses.replace(auto, tuning=str(other)))
    assert shipped["RADIANCE_AR_TUNING"] == tuning.shipped().digest
    assert here["RADIANCE_AR_TUNING"] != shipped["RADIANCE_AR_TUNING"]
