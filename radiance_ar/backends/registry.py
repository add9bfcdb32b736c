"""The backend registry: one table from name to class, filled by ``@register``.

Built-in backends live one per module (listed in ``_BUILTIN_MODULES``) and register
themselves when imported; the table is loaded on first use so that importing
``radiance_ar.backends`` stays cheap. Names are matched exactly (an alias is an explicit entry).
"""

from __future__ import annotations

import importlib
from typing import Callable, Mapping, TypeVar

from radiance_ar import envs
from radiance_ar.backends.interface import Backend

_BUILTIN_MODULES = ("radiance_ar.backends.stock", "radiance_ar.backends.sdma", "radiance_ar.backends.sdma_wht6", "radiance_ar.backends.symm_ref",
                    "radiance_ar.backends.oneshot_wht6")

_CLASSES: dict[str, type[Backend]] = {}
_ALIASES: dict[str, str] = {}
_loaded = False

B = TypeVar("B", bound=type[Backend])


def register(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[B], B]:
    """Class decorator: make ``cls`` available as ``name`` (and each alias)."""

    def decorate(cls: B) -> B:
        for key in (name, *aliases):
            if key in _CLASSES or key in _ALIASES:
                raise ValueError(f"backend name {key!r} is already registered")
        cls.name = name
        _CLASSES[name] = cls
        _ALIASES.update({alias: name for alias in aliases})
        return cls

    return decorate


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def names() -> list[str]:
    """Canonical names of every registered backend, in registration order."""
    _load_builtins()
    return list(_CLASSES)


def get(name: str) -> type[Backend]:
    """The backend class registered as ``name`` (or an alias of it)."""
    _load_builtins()
    canonical = _ALIASES.get(name, name)
    try:
        return _CLASSES[canonical]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(names())}"
                         + (f" (aliases: {', '.join(sorted(_ALIASES))})" if _ALIASES else "")
                         ) from None


def from_env(environ: Mapping[str, str] | None = None) -> type[Backend]:
    """The class chosen by ``RADIANCE_AR_BACKEND``; an unknown name names the variable."""
    name = envs.get("RADIANCE_AR_BACKEND", environ)
    try:
        return get(name)
    except ValueError as e:
        raise ValueError(f"RADIANCE_AR_BACKEND={name!r}: {e}") from None
