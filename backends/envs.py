"""Every environment knob of radiance-ar, declared once.

Both packages read settings through this module (``overlap`` included), so a knob has
exactly one name, one default, one parser and one help text. No other module reads
``os.environ``. A bad value raises ``ValueError`` naming the variable, the value and
what was expected; nothing falls back silently to a default. The launcher's and Triton's
own variables this project reacts to (``LOCAL_RANK``, ``TRITON_INTERPRET``) are read here
too, by :func:`torchrun_local_rank` and :func:`triton_interpreter`, and the CUDA driver
settings that emulated ranks need are set here, by :func:`prepare_cuda_for_emulated_ranks`.

    >>> from backends import envs
    >>> envs.get("RADIANCE_AR_OVERLAP_SLICES")
    4
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Knob:
    name: str
    default: str  # as it would be written in the environment
    parse: Callable[[str, str], Any]  # (variable name, raw text) -> value
    help: str


def parse_bool(name: str, raw: str) -> bool:
    if raw in ("1", "true", "True"):
        return True
    if raw in ("0", "false", "False", ""):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def _int_at_least(minimum: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
        return value

    return parse


def _float_above(minimum: float) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected a number > {minimum:g}") from None
        if not value > minimum or value != value or value == float("inf"):
            raise ValueError(f"{name}={raw!r}: expected a finite number > {minimum:g}")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
        return raw

    return parse


def _name(name: str, raw: str) -> str:
    # The registry checks the name against what is registered (backends.registry.from_env);
    # here only the shape of the text is checked.
    value = raw.strip()
    if not value:
        raise ValueError(f"{name}={raw!r}: expected a backend name")
    return value


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("RADIANCE_AR_OVERLAP", "0", parse_bool,
             "1 routes eligible RowParallel linears through radiance::linear_ar"),
        Knob("RADIANCE_AR_BACKEND", "stock", _name,
             "all-reduce strategy, a registry name (see backends.names())"),
        Knob("RADIANCE_AR_OVERLAP_MIN_M", "2048", _int_at_least(1),
             "rows at/above which the sliced pipeline runs; below it the stock path"),
        Knob("RADIANCE_AR_OVERLAP_SLICES", "4", _int_at_least(1),
             "number of row slices of the sliced pipeline"),
        Knob("RADIANCE_AR_ONESHOT_CTAS", "32", _int_at_least(1),
             "CTAs (workgroups) the oneshot_wht6 kernel holds; vLLM's custom AR uses 36"),
        Knob("RADIANCE_AR_SPIN_TIMEOUT_MS", "1000", _float_above(0.0),
             "longest wait for a peer's flag before a backend reports the peer missing; "
             "an unbounded spin can wedge an RDNA compute queue (prior-art notes)"),
        Knob("RADIANCE_AR_SDMA_SCHEDULE", "auto", _choice("auto", "oneshot", "twoshot"),
             "sdma transfer schedule; auto picks by message size and world size"),
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


#: CUDA driver settings for W emulated ranks on one GPU, each owning a stream that may park
#: on a stream wait-value: with the default 8 hardware connections, streams sharing a queue
#: block each other (seen on the H200 while building sdma; ROCm's equivalent is
#: GPU_MAX_HW_QUEUES); lazy module loading loads a kernel at its first launch, which can
#: synchronize the device while a rank's stream is parked on a peer's flag (a hang seen on
#: the H200, 2026-12-02).
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
