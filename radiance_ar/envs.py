"""Every environment knob of radiance-ar, declared once, and the backends' settings.

Each knob is one :class:`~radiance_ar.knob.Knob` in :data:`KNOBS`: its name, type, bounds,
default and meaning (the parsers live in :mod:`radiance_ar.knob`). Everything else is
derived from that declaration: the parser of its text, the field of
:class:`BackendSettings` (a backend knob), that field's check, and the settings table of
the docs (:func:`settings_table`). No other module reads ``os.environ``. A bad
value raises ``ValueError`` naming the variable, the value and what was expected; nothing
falls back silently to a default. The backend knobs reach the backends as one frozen
:class:`BackendSettings` (``cls(world, settings)``), checked in its constructor with the
bounds of the knobs, so a backend reads no environment and a test builds one without
touching it. The launcher's and Triton's own variables this project reacts to
(``LOCAL_RANK``, ``TRITON_INTERPRET``) are read here too, by :func:`torchrun_local_rank`
and :func:`triton_interpreter`, and the CUDA driver settings that emulated ranks need are
set here, by :func:`prepare_cuda_for_emulated_ranks`.

    >>> from radiance_ar import envs
    >>> envs.get("RADIANCE_AR_OVERLAP_SLICES", {})
    'auto'
    >>> envs.get("RADIANCE_AR_OVERLAP_SLICES", {"RADIANCE_AR_OVERLAP_SLICES": " 8"})
    8
"""

from __future__ import annotations

import os
from dataclasses import fields, make_dataclass, replace
from typing import Any, ClassVar, Mapping

from radiance_ar.knob import Knob

#: Bounds of RADIANCE_AR_SPIN_TIMEOUT_MS. Below 1 ms calls fail before a healthy peer can
#: arrive; past 10 minutes a missing peer looks like a hang (1e300 ms is one), which is
#: what the bound exists to prevent.
SPIN_TIMEOUT_MS_RANGE = (1.0, 600_000.0)
#: RADIANCE_AR_WATCHDOG_S's sanity bound: a day; a stall past it is a hang by any measure
WATCHDOG_S_MAX = 86_400.0
#: its shortest limit: a stall shorter than that is a healthy wait (a first call's kernel
#: compilation took 1.0-6.1 s on an H200 host), not a missing peer
WATCHDOG_S_MIN = 10.0
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
#: RADIANCE_AR_OP_GRAPHS: the first is the default
OP_GRAPHS = ("auto", "on", "off")
#: the op's graphs per process at most, and RADIANCE_AR_OP_GRAPHS_PER_LAYER's bound: a graph
#: holds a few hundred nodes (Llama-3.1-70B routes 160 linears: 4 shapes each, 640 graphs)
MAX_OP_GRAPHS, MAX_OP_GRAPHS_PER_LAYER = 4096, 64
#: retired knobs and what replaced them: set, they stop start-up (snapshot, given)
RETIRED_KNOBS = {"RADIANCE_AR_OP_GRAPHS_MAX": "RADIANCE_AR_OP_GRAPHS_PER_LAYER (graphs kept "
                 "per layer, not per process; docs/design.md 3.6)"}
#: the slicing plans of the op (radiance_ar/overlap/slicing.py), the first the default
OVERLAP_PLANS = ("uniform", "growing")
#: RADIANCE_AR_ACCURACY, the accuracy classes of RADIANCE_AR_BACKEND=auto
#: (radiance_ar/overlap/tuning.py), each allowing the ones before it; the first the default
ACCURACY_CLASSES = ("exact", "quantized")
#: the RADIANCE_AR_BACKEND word that chooses per call from a tuning table
AUTO_BACKEND = "auto"
#: the transfer schedules of the copy-engine backends (radiance_ar/backends/sdma.py, sdma_wht6.py)
SDMA_SCHEDULES = ("auto", "oneshot", "twoshot")
#: RADIANCE_AR_PEER_MEMORY: where GPU ranks in processes keep their peer buffers
#: (radiance_ar/transport/world.py, choose_peer_memory), the first the default
PEER_MEMORIES = ("auto", "symm", "host")


#: Every knob. The op's first, then the backend knobs in the order of BackendSettings'
#: fields (its positional arguments).
KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("RADIANCE_AR_OVERLAP", bool, False,
             "`1` routes eligible RowParallel linears through the op (`radiance::linear_ar`)"),
        Knob("RADIANCE_AR_BACKEND", str, "stock",
             "AR strategy: a registry name or alias (`python -c \"from radiance_ar import "
             "backends; print(backends.names())\"`), or `auto`: per call, the fastest "
             "configuration a tuning table measured for its M and N "
             "(`radiance_ar/overlap/tuning.py`, `RADIANCE_AR_TUNING`, `RADIANCE_AR_ACCURACY`)",
             names=f"a registered name, or {AUTO_BACKEND}"),
        Knob("RADIANCE_AR_TUNING", str, "",
             "`RADIANCE_AR_BACKEND=auto`: the tuning file `tools/tune.py` wrote on this "
             "machine; empty: the table shipped with the package, measured on an H200 (a "
             "warning says so once)",
             path=True),
        Knob("RADIANCE_AR_ACCURACY", str, ACCURACY_CLASSES[0],
             "`RADIANCE_AR_BACKEND=auto`: `exact` chooses among backends that add no error "
             "beyond rounding the sum once (stock, sdma); `quantized` also among the "
             "quantized ones (sdma_wht6, oneshot_wht6, within their `rel_rms_bound`)",
             words=ACCURACY_CLASSES),
        Knob("RADIANCE_AR_OVERLAP_MIN_M", int, 2048,
             "rows at/above which the sliced pipeline runs; below, GEMM then the vendor AR",
             lo=1),
        Knob("RADIANCE_AR_OVERLAP_SLICES", int, "auto",
             "row slices of the pipeline, or `auto`: the backend's measured choice "
             "(`Backend.preferred_slices_for`: per world size, rows and plan, each citing its run; "
             "`radiance_ar.overlap.slicing.slice_count`)",
             lo=1, hi=MAX_OVERLAP_SLICES, words=("auto",)),
        Knob("RADIANCE_AR_OVERLAP_PLAN", str, OVERLAP_PLANS[0],
             "how the rows are cut (`radiance_ar/overlap/slicing.py`): `uniform` (equal "
             "slices) or `growing` (slice k is 2^k parts of 2^S - 1: where the AR takes at "
             "least twice the GEMM's time only the first, small GEMM slice is exposed, while "
             "the AR stays S large calls)",
             words=OVERLAP_PLANS),
        Knob("RADIANCE_AR_OP_GRAPHS", str, "auto",
             "`on`: the op captures its sliced path once per shape into a CUDA graph and "
             "replays it, one launch per call (`radiance_ar/overlap/graphs.py`); `off`: every "
             "step of every slice is enqueued from Python; `auto`: on, except for emulated "
             "ranks with active peers (one process: a capture can block while a peer waits "
             "on this rank) and on ROCm (written, never run on an AMD GPU: `on` turns it on "
             "from ROCm 6.4, outside host-memory worlds). Where the op's calls are replayed, "
             "sdma and sdma_wht6 also run inside a caller's CUDA graph (vLLM's) where the "
             "watchdog runs (docs/design.md 3.6); `off` refuses that too",
             words=OP_GRAPHS),
        Knob("RADIANCE_AR_OP_GRAPHS_PER_LAYER", int, 4,
             "captured op calls kept per layer, one per M (a graph holds its layer's weight "
             "by address): a chunked prefill's recurring M values (the full chunk, a remainder "
             "that comes back) need one each; a capture drops a graph only for a shape called "
             "twice as often lately, so where more recur the others run step by step, and "
             "where recurring shapes crowd each other out a warning says so once "
             "(`radiance_ar/overlap/graph_room.py`). "
             f"At most {MAX_OP_GRAPHS} graphs in all per op runtime (one per process; under "
             "`RADIANCE_AR_BACKEND=auto`, one per configuration chosen)",
             lo=1, hi=MAX_OP_GRAPHS_PER_LAYER),
        Knob("RADIANCE_AR_PEER_MEMORY", str, PEER_MEMORIES[0],
             "where GPU ranks in processes keep their peer buffers and flags "
             "(`radiance_ar/transport/world.py`): `symm` (symmetric memory, one GPU per "
             "process, peer-to-peer), `host` (the gpu-host world: job-private shared host "
             "memory registered with each rank's runtime, DMA over each GPU's own link, no "
             "peer-to-peer; ranks may share a GPU; one host), `auto`: `symm` where every rank "
             "has a GPU of its own and every pair of them access each other as peers (or the "
             "ranks span hosts), else `host`; the choice and its reason logged once by rank "
             "0. CPU ranks always share memory files (cpu-shm)",
             words=PEER_MEMORIES),
        Knob("RADIANCE_AR_SPIN_TIMEOUT_MS", float, 1000.0,
             "longest wait, in ms, for a peer's flag before a call reports the peer missing "
             "(no hung GPU: an unbounded spin can wedge an RDNA compute queue)",
             lo=SPIN_TIMEOUT_MS_RANGE[0], hi=SPIN_TIMEOUT_MS_RANGE[1], field="spin_timeout_ms"),
        Knob("RADIANCE_AR_SDMA_SCHEDULE", str, "auto",
             "transfer schedule of `sdma` and `sdma_wht6`; `auto` picks by message size and "
             "world size. Under `RADIANCE_AR_BACKEND=auto` it must be the setting the tuning "
             "table was measured with (the shipped one: `auto`), else start-up stops",
             words=SDMA_SCHEDULES, field="sdma_schedule"),
        Knob("RADIANCE_AR_ONESHOT_CTAS", int, 32,
             "CTAs (workgroups) the spin-wait `oneshot_wht6` kernel holds; vLLM's custom AR "
             "uses 36",
             lo=1, hi=MAX_ONESHOT_CTAS, field="oneshot_ctas"),
        Knob("RADIANCE_AR_SDMA_REDUCE_CTAS", int, 0,
             "CTAs of the `sdma` reduce kernel; `0` = two per SM",
             lo=0, hi=MAX_REDUCE_CTAS, field="sdma_reduce_ctas"),
        Knob("RADIANCE_AR_SDMA_CALL_STREAMS", int, 2,
             "streams `sdma`'s calls run on; `2`: consecutive calls alternate, so one call's "
             "pulls overlap the previous call's reduce and waits "
             "(`radiance_ar/transport/call_streams.py`)",
             lo=1, hi=MAX_CALL_STREAMS, field="sdma_call_streams"),
        Knob("RADIANCE_AR_WATCHDOG_S", float, 600.0,
             "seconds a GPU rank's newest collective call may stay unfinished while its host "
             "enqueues nothing more, before the process stops (SIGABRT after logging who is "
             "missing, `radiance_ar/transport/watchdog.py`): a missing peer ends the job "
             "instead of leaving GPUs waiting for good (inside vLLM nothing else bounds a "
             "wait); also an op call inside a caller's CUDA graph whose counts stop moving. "
             "Where each rank is a process on a GPU (gpu-host, gpu-symm); the default 600 "
             "is NCCL's limit",
             lo=WATCHDOG_S_MIN, hi=WATCHDOG_S_MAX, off=0.0, field="watchdog_s"),
    )
}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of knob ``name`` (``ValueError`` if the text is bad)."""
    try:
        knob = KNOBS[name]
    except KeyError:
        raise KeyError(f"{name} is not a radiance-ar setting; known: {', '.join(KNOBS)}") from None
    env = os.environ if environ is None else environ
    raw = env.get(name)
    return knob.default if raw is None else knob.parse(raw)


def given(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The knobs that are set in the environment, parsed (``ValueError`` on a bad one);
    unset knobs are left out, not filled with their defaults."""
    env = os.environ if environ is None else environ
    refuse_retired(env)
    return {name: get(name, env) for name in KNOBS if name in env}


def refuse_retired(environ: Mapping[str, str] | None = None) -> None:
    """``ValueError`` naming a retired knob set in ``environ`` and its replacement."""
    env = os.environ if environ is None else environ
    for name, replacement in RETIRED_KNOBS.items():
        if env.get(name, "").strip():  # an empty one sets nothing that would be ignored
            raise ValueError(f"{name}={env[name]!r}: this setting is retired; use {replacement}")


def settings_table() -> str:
    """The markdown table of every knob (variable, default, meaning), as README.md and
    docs/design.md hold it between ``<!-- settings-table -->`` and
    ``<!-- /settings-table -->``."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | `{k.default_text}` | {k.doc}. Accepted: {k.expected} |"
             for k in KNOBS.values()]
    return "\n".join(rows) + "\n"


class _BackendSettingsBody:
    """The backend knobs, parsed and checked once; every backend is built as
    ``cls(world, settings)`` and reads its knobs from here, never from the environment.

    One field per knob of :data:`KNOBS` that names one (``Knob.field``), in their order,
    its default the knob's. ``BackendSettings()`` holds the defaults and reads no
    environment; :meth:`from_env` reads them from it. Every value is checked here, whoever
    builds the object (``from_env``, a test, a tool), with the bounds of its knob::

        >>> s = BackendSettings(spin_timeout_ms=300)
        >>> s.replace(sdma_schedule="twoshot").sdma_schedule
        'twoshot'

    A backend with a knob of its own declares it in :data:`KNOBS` with ``field=``.
    """

    #: field -> the knob it comes from
    KNOB_OF: ClassVar[dict[str, str]] = {k.field: k.name for k in KNOBS.values() if k.field}

    def __post_init__(self) -> None:
        for name, knob_name in self.KNOB_OF.items():
            knob, value = KNOBS[knob_name], getattr(self, name)
            if not knob.accepts(value):
                raise ValueError(f"BackendSettings: {name}={value!r} ({knob_name}): expected "
                                 f"{knob.expected}")
            if knob.type is float:  # an int given in code is the same setting, as a float
                object.__setattr__(self, name, float(value))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "BackendSettings":
        """Every backend knob parsed from the environment (``ValueError`` names a bad one)."""
        return cls(**{f.name: get(cls.KNOB_OF[f.name], environ) for f in fields(cls)})

    def replace(self, **changes: Any) -> "BackendSettings":
        """A copy with ``changes`` (checked alike): ``dataclasses.replace``."""
        return replace(self, **changes)


BackendSettings = make_dataclass(
    "BackendSettings",
    [(k.field, k.type, k.default) for k in KNOBS.values() if k.field],
    bases=(_BackendSettingsBody,), frozen=True,
    # make_dataclass would name the module it runs in (``types``), and pickling (the CPU
    # worlds' spawned processes get their settings so) finds classes by module.
    namespace={"__module__": __name__, "__qualname__": "BackendSettings",
               "__doc__": _BackendSettingsBody.__doc__})


def triton_interpreter(environ: Mapping[str, str] | None = None) -> bool:
    """Triton's own ``TRITON_INTERPRET=1`` (kernels run on the CPU): its bf16 dot is
    wrong there, so kernels switch to fp32 dots, and spin-waits cannot be satisfied."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET") == "1"


def _torchrun_int(name: str, default: int | None, environ: Mapping[str, str] | None) -> int | None:
    """The integer torchrun put in ``name``; ``default`` when it is not set."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer (set by torchrun)") from None


def torchrun_local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """``LOCAL_RANK`` as torchrun sets it; None when not launched by torchrun."""
    return _torchrun_int("LOCAL_RANK", None, environ)


def torchrun_local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """``LOCAL_WORLD_SIZE`` (ranks on this host) as torchrun sets it; 1 when not set."""
    return _torchrun_int("LOCAL_WORLD_SIZE", 1, environ)


def torchrun_rank(environ: Mapping[str, str] | None = None) -> int:
    """``RANK`` (the global rank) as torchrun sets it; 0 when not launched by torchrun."""
    return _torchrun_int("RANK", 0, environ)


#: Driver settings for W emulated ranks on one GPU, each owning a stream that may park on a
#: stream wait-value: with the default 8 hardware connections (CUDA) or 4 hardware queues
#: (ROCm's GPU_MAX_HW_QUEUES, rocclr's default), streams sharing a queue block each other
#: (ROCm's: not run on an AMD GPU; hip_hardware_queues reads what the runtime was given);
#: lazy module loading loads a
#: kernel at its first launch, which can synchronize the device while a rank's stream is
#: parked on a peer's flag, and then never returns. Both were hit on hardware:
#: docs/history.md.
EMULATED_RANKS_CUDA_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "CUDA_MODULE_LOADING": "EAGER",
                           "GPU_MAX_HW_QUEUES": "32"}
#: ROCm's variable, not ours (not in KNOBS: it is no setting of radiance-ar), parsed like one
HIP_HW_QUEUES = Knob("GPU_MAX_HW_QUEUES", int, 4, "ROCm's hardware queues per device (rocclr's "
                     "default 4)", lo=1)


def hip_hardware_queues(environ: Mapping[str, str] | None = None) -> int:
    """The hardware queues ROCm's runtime gives this process per device:
    ``GPU_MAX_HW_QUEUES``, else rocclr's default."""
    raw = (os.environ if environ is None else environ).get(HIP_HW_QUEUES.name, "")
    return HIP_HW_QUEUES.parse(raw) if raw.strip() else HIP_HW_QUEUES.default


def prepare_cuda_for_emulated_ranks(environ: dict[str, str] | None = None) -> None:
    """Set :data:`EMULATED_RANKS_CUDA_ENV` where unset. Only effective before CUDA
    initializes: call it at a tool's start, before anything touches ``torch.cuda``."""
    env = os.environ if environ is None else environ
    for name, value in EMULATED_RANKS_CUDA_ENV.items():
        env.setdefault(name, value)


def snapshot(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every knob parsed at once (a retired one refused), so that start-up reports all bad
    values up front."""
    refuse_retired(environ)
    return {name: get(name, environ) for name in KNOBS}
