"""Every environment knob of radiance-ar, declared once, and the backends' settings.

Both packages read settings through this module (``overlap`` included), so a knob has
exactly one name, one default, one parser and one help text. No other module reads
``os.environ``. A bad value raises ``ValueError`` naming the variable, the value and
what was expected; nothing falls back silently to a default. The backend knobs reach
the backends as one frozen :class:`BackendSettings` (``cls(world, settings)``),
validated in its constructor with the bounds of the knobs, so a backend reads no
environment and a test builds one without touching it. The launcher's and Triton's
own variables this project reacts to (``LOCAL_RANK``, ``TRITON_INTERPRET``) are read here
too, by :func:`torchrun_local_rank` and :func:`triton_interpreter`, and the CUDA driver
settings that emulated ranks need are set here, by :func:`prepare_cuda_for_emulated_ranks`.

    >>> from backends import envs
    >>> envs.get("RADIANCE_AR_OVERLAP_SLICES", {})
    'auto'
    >>> envs.get("RADIANCE_AR_OVERLAP_SLICES", {"RADIANCE_AR_OVERLAP_SLICES": " 8"})
    8
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, ClassVar, Mapping


@dataclass(frozen=True)
class Knob:
    name: str
    default: str  # as it would be written in the environment
    parse: Callable[[str, str], Any]  # (variable name, raw text) -> value
    help: str


def parse_bool(name: str, raw: str) -> bool:
    text = raw.strip()
    if text in ("1", "true", "True"):
        return True
    # An empty (or blank) value is off: ``VAR=`` in a launcher script means "not set".
    if text in ("0", "false", "False", ""):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def _range_text(lo: float, hi: float | None) -> str:
    return f">= {lo:g}" if hi is None else f"in [{lo:g}, {hi:g}]"


def _int_in(lo: int, hi: int | None = None, *,
            auto: bool = False) -> Callable[[str, str], int | str]:
    """Parser of an integer knob in ``[lo, hi]`` (``hi`` None: no upper bound); with
    ``auto`` the word ``auto`` is taken too and parses to itself."""
    expected = (f"expected {'auto or ' if auto else ''}an integer {_range_text(lo, hi)}, "
                "in ASCII digits")

    def parse(name: str, raw: str) -> int | str:
        text = raw.strip()
        if auto and text == "auto":
            return text
        # Only 0-9: int() alone would also take "1_0", "+3" and non-ASCII digits ("١٠"),
        # which no one means to write into a launcher script.
        if not (text.isascii() and text.isdigit()):
            raise ValueError(f"{name}={raw!r}: {expected}")
        try:
            value = int(text)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ValueError(f"{name}={raw!r}: {expected}") from None
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"{name}={raw!r}: {expected}")
        return value

    return parse


def _float_in(lo: float, hi: float) -> Callable[[str, str], float]:
    """Parser of a finite number knob in ``[lo, hi]``."""
    expected = f"expected a finite number {_range_text(lo, hi)}"

    def parse(name: str, raw: str) -> float:
        text = raw.strip()
        # Same spelling rule as the integers: float() also takes "1_0" and non-ASCII digits.
        if not text.isascii() or "_" in text:
            raise ValueError(f"{name}={raw!r}: {expected}")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: {expected}") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            raise ValueError(f"{name}={raw!r}: {expected}")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        text = raw.strip()
        if text not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
        return text

    return parse


def _name(name: str, raw: str) -> str:
    # The registry checks the name against what is registered (radiance_ar.backends.registry.from_env);
    # here only the shape of the text is checked.
    value = raw.strip()
    if not value:
        raise ValueError(f"{name}={raw!r}: expected a backend name")
    return value


#: Bounds of RADIANCE_AR_SPIN_TIMEOUT_MS. Below 1 ms calls fail before a healthy peer can
#: arrive; past 10 minutes a missing peer looks like a hang (1e300 ms is one), which is
#: what the bound exists to prevent.
SPIN_TIMEOUT_MS_RANGE = (1.0, 600_000.0)
#: Upper bounds of the integer knobs, as sanity limits rather than tuned values: at 64
#: slices a 2048-row prefill is already cut into 32-row slices, each still paying its own
#: launches and flag waits; 1024 CTAs is several times the SM count of current GPUs (132
#: on the H200), while oneshot_wht6 is meant to hold few compute units.
MAX_OVERLAP_SLICES = 64
MAX_ONESHOT_CTAS = 1024
#: RADIANCE_AR_SDMA_REDUCE_CTAS: 0 means two per SM (264 on the H200: a 4-input reduce of a
#: 20 MiB slice beside the 8192x4352x5120 GEMM cost it 1.05x there, 8-66 CTAs 1.11-1.14x,
#: as the slower reduce spans the whole GEMM); the same sanity bound as MAX_ONESHOT_CTAS.
MAX_REDUCE_CTAS = 1024
#: RADIANCE_AR_SDMA_CALL_STREAMS: 1 runs every call on the caller's stream; 2 alternates two
#: streams (radiance_ar/transport/call_streams.py)
MAX_CALL_STREAMS = 2
#: the slicing plans of the op (radiance_ar/overlap/slicing.py), the first the default
OVERLAP_PLANS = ("uniform", "growing")
#: the transfer schedules of the copy-engine backends (radiance_ar/backends/sdma.py, sdma_wht6.py)
SDMA_SCHEDULES = ("auto", "oneshot", "twoshot")


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("RADIANCE_AR_OVERLAP", "0", parse_bool,
             "1 routes eligible RowParallel linears through radiance::linear_ar"),
        Knob("RADIANCE_AR_BACKEND", "stock", _name,
             "all-reduce strategy, a registry name (see backends.names())"),
        Knob("RADIANCE_AR_OVERLAP_MIN_M", "2048", _int_in(1),
             "rows at/above which the sliced pipeline runs; below it the stock path (>= 1)"),
        Knob("RADIANCE_AR_OVERLAP_SLICES", "auto", _int_in(1, MAX_OVERLAP_SLICES, auto=True),
             "number of row slices of the sliced pipeline (1 to 64), or auto: the "
             "backend's measured best (Backend.preferred_slices)"),
        Knob("RADIANCE_AR_OVERLAP_PLAN", OVERLAP_PLANS[0], _choice(*OVERLAP_PLANS),
             "how the rows are cut: uniform (equal slices) or growing (each slice twice the "
             "one before; for an AR that takes at least twice the GEMM's time)"),
        Knob("RADIANCE_AR_ONESHOT_CTAS", "32", _int_in(1, MAX_ONESHOT_CTAS),
             "CTAs (workgroups) the oneshot_wht6 kernel holds (1 to 1024); vLLM's custom AR "
             "uses 36"),
        Knob("RADIANCE_AR_SPIN_TIMEOUT_MS", "1000", _float_in(*SPIN_TIMEOUT_MS_RANGE),
             "longest wait, in ms (1 to 600000), for a peer's flag before a backend reports "
             "the peer missing; an unbounded spin can wedge an RDNA compute queue"),
        Knob("RADIANCE_AR_SDMA_REDUCE_CTAS", "0", _int_in(0, MAX_REDUCE_CTAS),
             "CTAs of the sdma reduce kernel (0 to 1024); 0 = two per SM, the default"),
        Knob("RADIANCE_AR_SDMA_CALL_STREAMS", "2", _int_in(1, MAX_CALL_STREAMS),
             "streams sdma's calls run on (1 or 2); 2: consecutive calls alternate, so one "
             "call's pulls overlap the previous call's reduce and waits, the default"),
        Knob("RADIANCE_AR_SDMA_SCHEDULE", "auto", _choice(*SDMA_SCHEDULES),
             "transfer schedule of sdma and sdma_wht6; auto picks by message size and world "
             "size"),
    )
}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of knob ``name`` (``ValueError`` if the text is bad)."""
    try:
        knob = KNOBS[name]
    except KeyError:
        raise KeyError(f"{name} is not a radiance-ar setting; known: {', '.join(KNOBS)}") from None
    env = os.environ if environ is None else environ
    return knob.parse(name, env.get(name, knob.default))


def _default(name: str) -> Any:
    return KNOBS[name].parse(name, KNOBS[name].default)


@dataclass(frozen=True)
class BackendSettings:
    """The backend knobs, parsed and validated once; every backend is built as
    ``cls(world, settings)`` and reads its knobs from here, never from the environment.

    ``BackendSettings()`` holds the knobs' defaults and reads no environment;
    :meth:`from_env` reads them from it. Every value is checked here, whoever builds the
    object (``from_env``, a test, a tool), with the bounds of its knob::

        >>> s = BackendSettings(spin_timeout_ms=300)
        >>> s.replace(sdma_schedule="twoshot").sdma_schedule
        'twoshot'

    A backend with a knob of its own adds a field here, its knob to :data:`KNOBS` and
    the pair to ``KNOB_OF``.
    """

    #: RADIANCE_AR_SPIN_TIMEOUT_MS: longest wait for a peer before a call fails (ms)
    spin_timeout_ms: float = _default("RADIANCE_AR_SPIN_TIMEOUT_MS")
    #: RADIANCE_AR_SDMA_SCHEDULE: the sdma / sdma_wht6 transfer schedule (``SDMA_SCHEDULES``)
    sdma_schedule: str = _default("RADIANCE_AR_SDMA_SCHEDULE")
    #: RADIANCE_AR_ONESHOT_CTAS: CTAs the oneshot_wht6 kernel holds
    oneshot_ctas: int = _default("RADIANCE_AR_ONESHOT_CTAS")
    #: RADIANCE_AR_SDMA_REDUCE_CTAS: CTAs of the sdma reduce kernel, 0 = two per SM
    sdma_reduce_ctas: int = _default("RADIANCE_AR_SDMA_REDUCE_CTAS")
    #: RADIANCE_AR_SDMA_CALL_STREAMS: streams sdma's calls alternate on (1 or 2)
    sdma_call_streams: int = _default("RADIANCE_AR_SDMA_CALL_STREAMS")

    #: field -> the knob it comes from
    KNOB_OF: ClassVar[dict[str, str]] = {
        "spin_timeout_ms": "RADIANCE_AR_SPIN_TIMEOUT_MS",
        "sdma_schedule": "RADIANCE_AR_SDMA_SCHEDULE",
        "oneshot_ctas": "RADIANCE_AR_ONESHOT_CTAS",
        "sdma_reduce_ctas": "RADIANCE_AR_SDMA_REDUCE_CTAS",
        "sdma_call_streams": "RADIANCE_AR_SDMA_CALL_STREAMS",
    }

    def __post_init__(self) -> None:
        lo, hi = SPIN_TIMEOUT_MS_RANGE
        t = self.spin_timeout_ms
        if not (_is_number(t) and lo <= t <= hi and math.isfinite(t)):
            self._refuse("spin_timeout_ms", f"a finite number {_range_text(lo, hi)}")
        object.__setattr__(self, "spin_timeout_ms", float(t))
        if self.sdma_schedule not in SDMA_SCHEDULES:
            self._refuse("sdma_schedule", f"one of {', '.join(SDMA_SCHEDULES)}")
        c = self.oneshot_ctas
        if not (isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_ONESHOT_CTAS):
            self._refuse("oneshot_ctas", f"an integer {_range_text(1, MAX_ONESHOT_CTAS)}")
        r = self.sdma_reduce_ctas
        if not (isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_REDUCE_CTAS):
            self._refuse("sdma_reduce_ctas", f"an integer {_range_text(0, MAX_REDUCE_CTAS)}")
        c = self.sdma_call_streams
        if not (isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_CALL_STREAMS):
            self._refuse("sdma_call_streams", f"an integer {_range_text(1, MAX_CALL_STREAMS)}")

    def _refuse(self, field: str, expected: str) -> None:
        raise ValueError(f"BackendSettings: {field}={getattr(self, field)!r} "
                         f"({self.KNOB_OF[field]}): expected {expected}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "BackendSettings":
        """Every backend knob parsed from the environment (``ValueError`` names a bad one)."""
        return cls(**{f.name: get(cls.KNOB_OF[f.name], environ) for f in fields(cls)})

    def replace(self, **changes: Any) -> "BackendSettings":
        """A copy with ``changes`` (validated alike): ``dataclasses.replace``."""
        return replace(self, **changes)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def triton_interpreter(environ: Mapping[str, str] | None = None) -> bool:
    """Triton's own ``TRITON_INTERPRET=1`` (kernels run on the CPU): its bf16 dot is
    wrong there, so kernels switch to fp32 dots, and spin-waits cannot be satisfied."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET") == "1"


def torchrun_local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """``LOCAL_RANK`` as torchrun sets it, or None when not launched by torchrun."""
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_RANK")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r}: expected an integer (set by torchrun)") from None


def torchrun_rank(environ: Mapping[str, str] | None = None) -> int:
    """``RANK`` (the global rank) as torchrun sets it; 0 when not launched by torchrun."""
    env = os.environ if environ is None else environ
    raw = env.get("RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"RANK={raw!r}: expected an integer (set by torchrun)") from None


#: CUDA driver settings for W emulated ranks on one GPU, each owning a stream that may park
#: on a stream wait-value: with the default 8 hardware connections, streams sharing a queue
#: block each other (ROCm's equivalent is GPU_MAX_HW_QUEUES); lazy module loading loads a
#: kernel at its first launch, which can synchronize the device while a rank's stream is
#: parked on a peer's flag, and then never returns. Both were hit on hardware:
#: docs/history.md.
EMULATED_RANKS_CUDA_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "CUDA_MODULE_LOADING": "EAGER"}


def prepare_cuda_for_emulated_ranks(environ: dict[str, str] | None = None) -> None:
    """Set :data:`EMULATED_RANKS_CUDA_ENV` where unset. Only effective before CUDA
    initializes: call it at a tool's start, before anything touches ``torch.cuda``."""
    env = os.environ if environ is None else environ
    for name, value in EMULATED_RANKS_CUDA_ENV.items():
        env.setdefault(name, value)


def snapshot(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every knob parsed at once, so that start-up reports all bad values up front."""
    return {name: get(name, environ) for name in KNOBS}
