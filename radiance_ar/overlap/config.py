"""The op's validated settings, read once from the environment (docs/design.md, 'Settings').

The knobs themselves are declared in :mod:`radiance_ar.envs` (one parser for both
packages); this module turns them into :class:`OverlapSettings`: the op's own knobs,
the backend name checked against the registry (a typo stops start-up with the valid
choices listed), and the backend knobs as one :class:`radiance_ar.envs.BackendSettings`,
which the runtime hands to the backend it builds.

Settings come from the environment (:func:`from_env`) or from code
(``OverlapSettings(...)``). Given in code they win, but the environment is still checked
against them (:func:`reconcile`): a bad value stops start-up either way, and a knob set
to something other than the code's value is reported, so that a launcher's variable
that has no effect does not go unnoticed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

from radiance_ar import backends
from radiance_ar import envs
from radiance_ar.envs import BackendSettings

logger = logging.getLogger("radiance_ar")


@dataclass(frozen=True)
class OverlapSettings:
    enabled: bool  # RADIANCE_AR_OVERLAP
    backend: str  # RADIANCE_AR_BACKEND, canonical registry name or "auto"
    min_m: int  # RADIANCE_AR_OVERLAP_MIN_M
    slices: int | str  # RADIANCE_AR_OVERLAP_SLICES: 1..64 or "auto" (see slice_count)
    #: every backend knob (``BackendSettings``); default: the knobs'
    #: defaults, not the environment (from_env reads them from it)
    backend_settings: BackendSettings = field(default_factory=BackendSettings)
    #: RADIANCE_AR_OVERLAP_PLAN (radiance_ar/overlap/slicing.py); keyword-only, after the settings
    plan: str = field(default=envs.OVERLAP_PLANS[0], kw_only=True)
    #: RADIANCE_AR_OP_GRAPHS, RADIANCE_AR_OP_GRAPHS_PER_LAYER (radiance_ar/overlap/graphs.py)
    graphs: str = field(default=envs.KNOBS["RADIANCE_AR_OP_GRAPHS"].default, kw_only=True)
    graphs_per_layer: int = field(default=envs.KNOBS["RADIANCE_AR_OP_GRAPHS_PER_LAYER"].default,
                                  kw_only=True)
    #: RADIANCE_AR_TUNING, RADIANCE_AR_ACCURACY: backend ``auto``'s table ("" : the shipped
    #: one) and accuracy class (radiance_ar/overlap/tuning.py)
    tuning: str = field(default=envs.KNOBS["RADIANCE_AR_TUNING"].default, kw_only=True)
    accuracy: str = field(default=envs.KNOBS["RADIANCE_AR_ACCURACY"].default, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.plan, str) or not isinstance(self.backend_settings,
                                                            BackendSettings):
            raise TypeError(f"OverlapSettings: plan {self.plan!r} must be a str and "
                            f"backend_settings a BackendSettings")
        if self.plan not in envs.OVERLAP_PLANS:
            raise ValueError(f"OverlapSettings: plan {self.plan!r}: expected one of "
                             f"{', '.join(envs.OVERLAP_PLANS)}")
        if self.slices != "auto" and (not isinstance(self.slices, int)
                                      or isinstance(self.slices, bool) or self.slices < 1):
            raise ValueError(f"OverlapSettings: slices {self.slices!r}: expected an int >= 1 "
                             "or 'auto'")
        for name in ("graphs", "graphs_per_layer", "tuning", "accuracy"):
            knob = envs.KNOBS[KNOB_OF[name]]
            if not knob.accepts(getattr(self, name)):
                raise ValueError(f"OverlapSettings: {name} {getattr(self, name)!r}: expected "
                                 f"{knob.expected}")


#: OverlapSettings field -> the knob it comes from (the backend knobs:
#: ``BackendSettings.KNOB_OF``)
KNOB_OF = {
    "enabled": "RADIANCE_AR_OVERLAP",
    "backend": "RADIANCE_AR_BACKEND",
    "min_m": "RADIANCE_AR_OVERLAP_MIN_M",
    "slices": "RADIANCE_AR_OVERLAP_SLICES",
    "plan": "RADIANCE_AR_OVERLAP_PLAN",
    "graphs": "RADIANCE_AR_OP_GRAPHS",
    "graphs_per_layer": "RADIANCE_AR_OP_GRAPHS_PER_LAYER",
    "tuning": "RADIANCE_AR_TUNING",
    "accuracy": "RADIANCE_AR_ACCURACY",
}

#: Knobs that are not the op's: read where their thing is built, not by OverlapSettings.
#: reconcile parses them (a bad value still stops start-up) but has no code value to
#: compare them with.
NOT_OP_KNOBS = {
    "RADIANCE_AR_PEER_MEMORY": "the world's (radiance_ar/transport/world.py)",
}


def check_tuning(path: str) -> None:
    """RADIANCE_AR_TUNING, where set, names a tuning file that loads (a typo or a stale
    file stops start-up, whatever the backend): ``ValueError`` naming the variable."""
    if path:
        from radiance_ar.overlap import tuning
        try:
            tuning.load(path)
        except ValueError as e:
            raise ValueError(f"RADIANCE_AR_TUNING={path!r}: {e}") from None


def backend_name(environ: Mapping[str, str] | None = None) -> str:
    """RADIANCE_AR_BACKEND checked: ``auto`` (radiance_ar/overlap/tuning.py), else the
    registry's canonical name (an unknown name raises, naming the variable)."""
    if envs.get("RADIANCE_AR_BACKEND", environ) == envs.AUTO_BACKEND:
        return envs.AUTO_BACKEND
    return backends.from_env(environ).name


def from_env(environ: Mapping[str, str] | None = None) -> OverlapSettings:
    """Every knob validated (all of them, not only the op's); ``ValueError`` on a bad one."""
    values = envs.snapshot(environ)
    # the registry's check of the name, and an alias's canonical name
    values["RADIANCE_AR_BACKEND"] = backend_name(environ)
    check_tuning(values["RADIANCE_AR_TUNING"])
    return OverlapSettings(**{name: values[knob] for name, knob in KNOB_OF.items()},
                           backend_settings=BackendSettings.from_env(environ))


#: (variable, its value, the code's value) already reported by :func:`reconcile`: a
#: runtime is built once per configure, and a process may configure many times
_reported: set[tuple[str, str, str]] = set()


def reconcile(settings: OverlapSettings,
              environ: Mapping[str, str] | None = None) -> OverlapSettings:
    """``settings`` given in code, checked against the environment; returns them unchanged.

    The code's values win. Every knob set in the environment is still parsed, so a bad
    value raises ``ValueError`` naming it, as it does when the settings come from the
    environment (also the knobs that are not the op's, :data:`NOT_OP_KNOBS`, which have
    no code value to compare with); one whose value differs from the code's is reported once, as a warning
    on the ``radiance_ar`` logger naming the variable, its value and the code's value.
    """
    if not isinstance(settings, OverlapSettings):
        raise TypeError(f"reconcile: settings must be an OverlapSettings, got "
                        f"{type(settings).__name__}")
    code = {knob: (name, getattr(settings, name)) for name, knob in KNOB_OF.items()}
    code.update({knob: (f"backend_settings.{name}", getattr(settings.backend_settings, name))
                 for name, knob in BackendSettings.KNOB_OF.items()})
    given = envs.given(environ)
    check_tuning(given.get("RADIANCE_AR_TUNING", ""))
    if "RADIANCE_AR_BACKEND" in given:
        # the registry's check of the name; an alias names the same backend as its
        # canonical name, in the environment and in code alike
        given["RADIANCE_AR_BACKEND"] = backend_name(environ)
        code["RADIANCE_AR_BACKEND"] = ("backend", settings.backend
                                       if settings.backend == envs.AUTO_BACKEND
                                       else backends.get(settings.backend).name)
    assert set(code) | set(NOT_OP_KNOBS) == set(envs.KNOBS), "a knob neither op's nor world's"
    for name, value in given.items():
        if name in NOT_OP_KNOBS:
            continue
        where, code_value = code[name]
        key = (name, repr(value), repr(code_value))
        if value != code_value and key not in _reported:
            _reported.add(key)
            logger.warning("%s=%r in the environment differs from the settings given in code "
                           "(%s=%r); the code's value is used", name, value, where, code_value)
    return settings
