"""vLLM general plugin: ``RADIANCE_AR_OVERLAP=1 vllm serve MODEL -tp N`` with no code change.

pyproject.toml declares ``radiance_ar = "radiance_ar.overlap.vllm_plugin:register"`` in the
``vllm.general_plugins`` group; vLLM calls :func:`register` in every process it starts
(``vllm.plugins.load_general_plugins``: API server, engine core, and each worker in
``WorkerWrapperBase.init_worker`` before the worker builds its model). It does three things:

1. Validates every radiance-ar knob (``radiance_ar.overlap.config.from_env``): a bad value stops
   vLLM at start-up with the variable, the value and the valid choices.
2. Keys vLLM's torch.compile cache on the overlap flag and backend. vLLM names the
   cache directory after a hash whose environment part is ``vllm.envs.compile_factors()``,
   which reads every getter in ``vllm.envs.environment_variables``; the plugin adds
   ``RADIANCE_AR_OVERLAP`` and ``RADIANCE_AR_BACKEND`` there (under ``auto`` also the
   accuracy and the tuning table's digest: :func:`compile_cache_factors`). Without this a warm cache
   from a run with the flag off replays the old graph (vLLM's all-reduce, not our op)
   and silently ignores the feature. (Checked against vLLM 0.32 and 0.34:
   ``vllm/compilation/backends.py`` and ``caching.py`` hash ``envs.compile_factors()``.)
3. With RADIANCE_AR_OVERLAP=1, hooks model loading: the ``load_model`` of vLLM's model
   loaders (``vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model``
   and each loader class that overrides it) is wrapped so that the loaded model, after
   ``process_weights_after_loading`` and before the runner compiles it or captures CUDA
   graphs, goes through :func:`radiance_ar.overlap.vllm_install.install`. The wrap happens when vLLM
   imports ``vllm.model_executor.model_loader`` (an import hook), so processes that never
   load a model (the API server) never import it for us.

:func:`register` may run several times in one process; every step is idempotent.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

from radiance_ar.envs import AUTO_BACKEND
from radiance_ar.overlap.auto import table_for
from radiance_ar.overlap.config import OverlapSettings, from_env
from radiance_ar.overlap.vllm_install import install, logger

LOADER_PACKAGE = "vllm.model_executor.model_loader"
#: the knobs that change what torch.compile traces in a vLLM model: which layers are routed
#: (the flag; the backend's gate on N; under auto, the table's rows for the accuracy)
COMPILE_CACHE_KNOBS = ("RADIANCE_AR_OVERLAP", "RADIANCE_AR_BACKEND", "RADIANCE_AR_ACCURACY",
                       "RADIANCE_AR_TUNING")
_WRAPPED = "__radiance_ar_wrapped__"


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see the module docstring)."""
    settings = from_env()
    add_compile_cache_factors()
    if settings.enabled:
        hook_model_loading()


def compile_cache_factors(settings: OverlapSettings) -> dict[str, object]:
    """The compile-cache factors of this run. With the flag on the traced graph holds our op,
    and the backend is keyed with it (the op hides the backend from the trace; keying it
    makes a cache entry name exactly what ran, and its gate on N decides which layers are
    routed). Under ``auto`` the accuracy and the tuning table's content (its digest) decide
    that too: a layer whose N the table has no row for stays stock. With the flag off no
    layer is routed and nothing else is keyed, so a stray setting costs no recompile."""
    auto = settings.enabled and settings.backend == AUTO_BACKEND
    return {"RADIANCE_AR_OVERLAP": settings.enabled,
            "RADIANCE_AR_BACKEND": settings.backend if settings.enabled else None,
            "RADIANCE_AR_ACCURACY": settings.accuracy if auto else None,
            "RADIANCE_AR_TUNING": table_for(settings).digest if auto else None}


def _factor(name: str) -> object:
    return compile_cache_factors(from_env())[name]


def add_compile_cache_factors(venvs: Any = None) -> bool:
    """Add our knobs to the environment factors vLLM hashes into its compile-cache key.

    ``venvs`` is ``vllm.envs`` (the default). Returns False, with a warning saying how to
    key the cache by hand, when it has no ``environment_variables`` / ``compile_factors``.
    """
    if venvs is None:
        import vllm.envs as venvs

    table = getattr(venvs, "environment_variables", None)
    if not isinstance(table, dict) or not callable(getattr(venvs, "compile_factors", None)):
        logger.warning(
            "radiance-ar: this vLLM does not hash plugin environment factors into its "
            "compile-cache key; give overlap runs their own cache (VLLM_CACHE_ROOT=<dir "
            "named after RADIANCE_AR_OVERLAP and RADIANCE_AR_BACKEND, under auto also "
            "RADIANCE_AR_ACCURACY and RADIANCE_AR_TUNING>, or "
            "-O '{\"cache_dir\": ...}'), or a warm cache replays the graph without the op")
        return False
    for name in COMPILE_CACHE_KNOBS:
        table.setdefault(name, functools.partial(_factor, name))
    return True


def _wrap_load_model(load_model: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(load_model, _WRAPPED, False):
        return load_model

    @functools.wraps(load_model)
    def load_model_then_install(self, *args: Any, **kwargs: Any) -> Any:
        model = load_model(self, *args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        install(model, vllm_config=vllm_config)
        return model

    setattr(load_model_then_install, _WRAPPED, True)
    return load_model_then_install


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def patch_loaders(loader_module: Any) -> int:
    """Wrap ``load_model`` wherever a loader class defines it; returns how many it wrapped.

    ``loader_module`` is ``vllm.model_executor.model_loader``; the classes are
    ``BaseModelLoader``, its subclasses, and those registered by load format.
    """
    base = loader_module.BaseModelLoader
    classes = set(_all_subclasses(base))
    classes.update(getattr(loader_module, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).values())
    wrapped = 0
    for cls in classes:
        own = cls.__dict__.get("load_model")
        if own is not None and not getattr(own, _WRAPPED, False):
            setattr(cls, "load_model", _wrap_load_model(own))
            wrapped += 1
    return wrapped


class AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: lets Python import module ``fullname`` as usual, then calls ``callback(module)``.

    It stands first in ``sys.meta_path`` until that import runs, then removes itself.
    """

    def __init__(self, fullname: str, callback: Callable[[Any], object]) -> None:
        self.fullname, self.callback = fullname, callback
        self._inner: importlib.abc.Loader | None = None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname or self._inner is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._inner, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._inner.exec_module(module)
        finally:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        self.callback(module)


def hook_model_loading() -> None:
    """Make every vLLM model load end in :func:`install` (now, or when vLLM imports its loaders)."""
    module = sys.modules.get(LOADER_PACKAGE)
    if module is not None:
        patch_loaders(module)
    elif not any(isinstance(f, AfterImport) and f.fullname == LOADER_PACKAGE
                 for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(LOADER_PACKAGE, patch_loaders))
