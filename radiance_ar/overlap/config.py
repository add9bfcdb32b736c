"""The op's validated settings, read once from the environment (docs/design.md, 'Settings').

The knobs themselves are declared in :mod:`radiance_ar.envs` (one parser for both
packages); this module turns them into :class:`OverlapSettings`: the op's own knobs,
the backend name checked against the registry (a typo stops start-up with the valid
choices listed), and the backend knobs as one :class:`radiance_ar.envs.BackendSettings`,
which the runtime hands to the backend it builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from radiance_ar import backends
from radiance_ar import envs
from radiance_ar.envs import BackendSettings


@dataclass(frozen=True)
class OverlapSettings:
    enabled: bool  # RADIANCE_AR_OVERLAP
    backend: str  # RADIANCE_AR_BACKEND, canonical registry name
    min_m: int  # RADIANCE_AR_OVERLAP_MIN_M
    slices: int | str  # RADIANCE_AR_OVERLAP_SLICES: 1..64 or "auto" (see slice_count)
    #: the backend knobs (spin timeout, sdma schedule, oneshot CTAs); default: the knobs'
    #: defaults, not the environment (from_env reads them from it)
    backend_settings: BackendSettings = field(default_factory=BackendSettings)
    #: RADIANCE_AR_OVERLAP_PLAN (radiance_ar/overlap/slicing.py); keyword-only, after the settings
    plan: str = field(default=envs.OVERLAP_PLANS[0], kw_only=True)

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


def from_env(environ: Mapping[str, str] | None = None) -> OverlapSettings:
    """Every knob validated (all of them, not only the op's); ``ValueError`` on a bad one."""
    values = envs.snapshot(environ)
    return OverlapSettings(
        enabled=values["RADIANCE_AR_OVERLAP"],
        backend=backends.from_env(environ).name,
        min_m=values["RADIANCE_AR_OVERLAP_MIN_M"],
        slices=values["RADIANCE_AR_OVERLAP_SLICES"],
        backend_settings=BackendSettings.from_env(environ),
        plan=values["RADIANCE_AR_OVERLAP_PLAN"],
    )
