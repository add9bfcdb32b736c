"""Tuning files and ``RADIANCE_AR_BACKEND=auto``'s per-call choice (issue 30).

A tuning file is what ``tools/tune.py`` measured on one machine: every candidate
configuration (backend, schedule, slices S, plan) per world size W, columns N, rows M and
producer, each with its measured op time. Its JSON::

    {"format": "radiance-ar-tuning", "version": 1,
     "device": "NVIDIA H200", "runtime": "torch 2.11.0+cu130, cuda 13.0",
     "world": "gpu-emulated", "measured_at": "2026-12-04T05:22:58", "command": "...",
     "note": "...",                       # optional: where the rows came from
     "sdma_schedule": "auto",             # optional (default auto): the tune's
                                          # RADIANCE_AR_SDMA_SCHEDULE
     "rows": [{"backend": "sdma", "schedule": "oneshot", "W": 2, "N": 5120, "K": 4352,
               "M": 8192, "producer": "bf16", "slices": 4, "plan": "uniform",
               "t_ms": 2.0038, "spread_ms": 0.01, "correct": true}, ...]}

:func:`choose` is the per-call choice, a pure function of the table and the call::

    rows of (W, N, producer) in the allowed accuracy classes, correct, timed
    M* = the measured M nearest to the call's M (|log M - log M*| least; a tie: the smaller)
    choice = the row of least t_ms at M*

The baseline arm (:data:`BASELINE_ARMS`: what a deployment runs without this project;
tools/baseline.py's ``vs base``) is a candidate wherever its accuracy class is allowed,
so ``auto`` never chooses a configuration measured slower than it. Every choice carries
the base's time at M* (``Choice.base_ms``) and says whether the base was a candidate.

Accuracy classes (``Backend.quantized``): ``exact`` backends sum the inputs' values as
given, rounding once (stock, sdma); ``quantized`` ones carry a quantized payload, within
their ``rel_rms_bound`` (oneshot_wht6: 2^-5; sdma_wht6: 2^-5 one-shot, 2^-4 + 2^-10 where
it may run two-shot). ``RADIANCE_AR_ACCURACY=exact``
(the default) chooses among exact rows only; ``quantized`` among both.

A file that cannot be read, is not this format or version, names a backend, plan or
producer this package does not have, or holds no usable row, raises ``ValueError`` naming
the file: ``auto`` never falls back silently. :func:`shipped` is the table inside the
package (``tuning_h200.json``, measured on an H200), used when ``RADIANCE_AR_TUNING`` is
unset. :meth:`TuningTable.signature_word` (of :attr:`TuningTable.digest`, the file's bytes,
the accuracy and the usable backends) joins every call's signature (``CallSignature.tuning``),
and ranks whose words differ raise ``CollectiveMismatchError`` at the auto runtime's
agreement, before their first sliced call.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterable

from radiance_ar import backends
from radiance_ar.envs import ACCURACY_CLASSES, OVERLAP_PLANS, SDMA_SCHEDULES

FORMAT = "radiance-ar-tuning"
#: bump when a row's meaning changes: a file of another version is refused, not guessed at
VERSION = 1
#: the table shipped with the package (RADIANCE_AR_TUNING unset)
SHIPPED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning_h200.json")

#: world kind -> (backend, slices) of the baseline arm, and why it is the base: ``stock``
#: unsliced where a vendor collective exists; the emulated and gpu-host worlds have none
#: that times like the others, so the spin-wait backend this project replaces, unsliced
BASELINE_ARMS = {
    "gpu-emulated": (("oneshot_wht6", 1), "the spin-wait AR this project replaces, unsliced: "
                                          "emulated ranks have no vendor collective"),
    "gpu-host": (("oneshot_wht6", 1), "the spin-wait AR this project replaces, unsliced: "
                                      "timed on one active rank like the others, where "
                                      "stock (gloo, when ranks share a GPU) needs every rank"),
    "cpu-shm": (("stock", 1), "the vendor collective, unsliced"),
    "gpu-symm": (("stock", 1), "the vendor collective, unsliced"),
}

_HEADER_KEYS = {"device": str, "runtime": str, "world": str, "measured_at": str,
                "command": str, "rows": list}
_ROW_KEYS = {"backend": str, "W": int, "N": int, "M": int, "producer": str, "slices": int,
             "plan": str, "t_ms": (int, float), "correct": bool}


def baseline_arm(world_kind: str) -> tuple[tuple[str, int], str]:
    """The baseline arm of ``world_kind`` and why it is the base (:data:`BASELINE_ARMS`;
    a world kind not listed has a vendor collective: ``stock``)."""
    return BASELINE_ARMS.get(world_kind, BASELINE_ARMS["gpu-symm"])


def accuracy_class(backend: str) -> str:
    """``exact`` or ``quantized`` (module doc) for the backend registered as ``backend``."""
    return ACCURACY_CLASSES[1] if backends.get(backend).quantized else ACCURACY_CLASSES[0]


def allowed_classes(accuracy: str) -> tuple[str, ...]:
    """The accuracy classes ``RADIANCE_AR_ACCURACY=accuracy`` lets ``auto`` choose from."""
    if accuracy not in ACCURACY_CLASSES:
        raise ValueError(f"accuracy {accuracy!r}: expected one of {', '.join(ACCURACY_CLASSES)}")
    return ACCURACY_CLASSES[:ACCURACY_CLASSES.index(accuracy) + 1]


def cut_label(slices: int, plan: str = "") -> str:
    """``unsliced``, ``S=4 growing`` (or ``S=4`` with no plan): how a configuration cuts the
    call."""
    return "unsliced" if slices == 1 else f"S={slices} {plan}".rstrip()


def arm_label(arm: tuple[str, int]) -> str:
    """``oneshot_wht6 unsliced`` / ``sdma S=4``: a baseline arm (backend, slices), whose
    plan is the setting's default."""
    name, slices = arm
    return f"{name} {cut_label(slices)}"


@dataclass(frozen=True)
class Row:
    """One measured configuration (a tuning file's row)."""

    backend: str
    W: int
    N: int
    M: int
    producer: str
    slices: int
    plan: str
    t_ms: float
    correct: bool
    #: the transfer schedule it ran (None: a backend with one way of doing a call)
    schedule: str | None = None
    K: int = 0
    spread_ms: float | None = None

    @property
    def accuracy(self) -> str:
        return accuracy_class(self.backend)

    def label(self) -> str:
        sched = f" {self.schedule}" if self.schedule else ""
        return f"{self.backend}{sched} {cut_label(self.slices, self.plan)}"


@dataclass(frozen=True)
class Choice:
    """What ``auto`` runs for one call, and why (:func:`choose`)."""

    backend: str
    slices: int
    plan: str
    schedule: str | None
    #: the measured M the choice was made at (the call's nearest)
    measured_m: int
    t_ms: float
    reason: str
    #: the baseline arm (``backend unsliced``) and its time at ``measured_m`` (None: the
    #: table did not measure it there)
    base: str = ""
    base_ms: float | None = None

    def label(self) -> str:
        return f"{self.backend} {cut_label(self.slices, self.plan)}"


@dataclass(frozen=True)
class TuningTable:
    path: str
    device: str
    runtime: str
    world: str
    measured_at: str
    command: str
    rows: tuple[Row, ...]
    #: sha256 of the file's bytes: two ranks with equal digests hold the same table
    digest: str
    note: str = ""
    #: RADIANCE_AR_SDMA_SCHEDULE of the runs the rows come from: sdma's and sdma_wht6's
    #: rows hold that setting's times (:func:`schedule_reason`)
    sdma_schedule: str = "auto"

    @property
    def shipped(self) -> bool:
        return os.path.abspath(self.path) == SHIPPED_PATH

    def describe(self) -> str:
        where = "the table shipped with radiance-ar" if self.shipped else f"tuning file {self.path}"
        return f"{where} (measured on {self.device}, {self.world}, {self.measured_at})"

    def signature_word(self, accuracy: str, usable: Iterable[str] = ()) -> int:
        """A positive 31-bit number for ``CallSignature.tuning``: the table, the accuracy
        class asked for and the backends this rank can run (``usable``: their gates pass
        here, which may differ between ranks' environments), which decide every choice."""
        h = hashlib.sha256(f"{self.digest}/{accuracy}/{','.join(sorted(usable))}"
                           .encode()).digest()
        return (int.from_bytes(h[:4], "little") >> 1) or 1


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"tuning file {path}: {what} (write it again with tools/tune.py)")


def _checked(path: str, obj: Any, keys: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise _fail(path, f"{where} is not a JSON object")
    for key, kind in keys.items():
        value = obj.get(key)
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise _fail(path, f"{where}: {key!r} missing or not {getattr(kind, '__name__', 'a number')}")


def _row(path: str, i: int, raw: Any) -> Row:
    where = f"row {i}"
    _checked(path, raw, _ROW_KEYS, where)
    try:
        backend = backends.get(raw["backend"]).name
    except ValueError as e:
        raise _fail(path, f"{where}: {e}") from None
    from radiance_ar.overlap import producers
    if raw["producer"] not in producers.names():
        raise _fail(path, f"{where}: producer {raw['producer']!r} is not one of "
                          f"{', '.join(producers.names())}")
    if raw["plan"] not in OVERLAP_PLANS:
        raise _fail(path, f"{where}: plan {raw['plan']!r}: expected one of {', '.join(OVERLAP_PLANS)}")
    if min(raw["W"], raw["N"], raw["M"], raw["slices"]) < 1 or not raw["t_ms"] > 0:
        raise _fail(path, f"{where}: W, N, M, slices must be >= 1 and t_ms > 0")
    return Row(backend, raw["W"], raw["N"], raw["M"], raw["producer"], raw["slices"],
               raw["plan"], float(raw["t_ms"]), raw["correct"], raw.get("schedule"),
               raw.get("K", 0), raw.get("spread_ms"))


#: the table parsed last per path, with the sha256 of its bytes: start-up checks
#: RADIANCE_AR_TUNING and auto loads it again; the bytes are read each time, so an edited
#: file is parsed anew (and replaces its entry)
_PARSED: dict[str, tuple[str, TuningTable]] = {}


def load(path: str) -> TuningTable:
    """The tuning file at ``path``, checked (module doc); ``ValueError`` naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _fail(path, f"cannot be read ({e.strerror or e})") from None
    digest = hashlib.sha256(data).hexdigest()
    hit = _PARSED.get(path)
    if hit is None or hit[0] != digest:
        hit = _PARSED[path] = (digest, _parse(path, data, digest))
    return hit[1]


def _parse(path: str, data: bytes, digest: str) -> TuningTable:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise _fail(path, f"is not JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _fail(path, f"is not a {FORMAT} file")
    if obj.get("version") != VERSION:
        raise _fail(path, f"is version {obj.get('version')!r}; this radiance-ar reads version "
                          f"{VERSION} (the file is stale)")
    _checked(path, obj, _HEADER_KEYS, "header")
    schedule = obj.get("sdma_schedule", "auto")
    if schedule not in SDMA_SCHEDULES:
        raise _fail(path, f"sdma_schedule {schedule!r}: expected one of {', '.join(SDMA_SCHEDULES)}")
    rows = tuple(_row(path, i, r) for i, r in enumerate(obj["rows"]))
    if not any(r.correct for r in rows):
        raise _fail(path, "holds no correct, timed row")
    return TuningTable(path, obj["device"], obj["runtime"], obj["world"], obj["measured_at"],
                       obj["command"], rows, digest, obj.get("note", ""), schedule)


def schedule_reason(table: TuningTable, sdma_schedule: str) -> str | None:
    """Why ``auto`` cannot choose from ``table`` with RADIANCE_AR_SDMA_SCHEDULE set to
    ``sdma_schedule`` (None: it can): its sdma and sdma_wht6 rows are times of another
    schedule setting, and a child backend runs the environment's."""
    if sdma_schedule == table.sdma_schedule:
        return None
    return (f"RADIANCE_AR_SDMA_SCHEDULE={sdma_schedule} with RADIANCE_AR_BACKEND=auto: "
            f"{table.describe()} was measured with RADIANCE_AR_SDMA_SCHEDULE="
            f"{table.sdma_schedule}, so its sdma and sdma_wht6 times are not this setting's; "
            "set it as the table was measured, or tune with it set (tools/tune.py)")


def shipped() -> TuningTable:
    """The table shipped inside the package (measured on an H200; see its ``note``)."""
    return load(SHIPPED_PATH)


def dump(path: str, header: dict, rows: list[dict]) -> None:
    """Write a tuning file (``tools/tune.py``): ``header`` holds the :data:`_HEADER_KEYS`
    but ``rows``; written to a temporary file of a unique name beside it (mode 0600),
    flushed to disk and renamed, so an interrupted write never leaves half a file under
    ``path``, and a failed one leaves no temporary file."""
    obj = {"format": FORMAT, "version": VERSION, **header, "rows": rows}
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _nearest(measured: list[int], m: int) -> int:
    """The measured M nearest ``m`` by ratio (exact: 4 and 9 are as near 6), the smaller
    of a tie."""
    return min(measured, key=lambda x: (Fraction(max(x, m), min(x, m)), x))


def choose(table: TuningTable, W: int, N: int, M: int, producer: str, accuracy: str,
           usable: Callable[[str], bool] = lambda name: True) -> Choice:
    """The fastest measured configuration for a call of ``M`` x ``N`` in a world of ``W``
    ranks (module doc). ``usable(backend)``: whether this world can run it (a backend's
    gate). ``ValueError`` naming the table where it has no row for the call."""
    classes = allowed_classes(accuracy)
    pool = [r for r in table.rows if r.W == W and r.N == N and r.producer == producer
            and r.correct and r.accuracy in classes and usable(r.backend)]
    if not pool:
        tuned = sorted({(r.W, r.N, r.producer) for r in table.rows})
        raise ValueError(
            f"{table.describe()} has no correct {'/'.join(classes)} row usable here for W = {W}, "
            f"N = {N}, producer {producer} (tuned W, N, producer: {tuned}); tune this shape "
            "(tools/tune.py) or set RADIANCE_AR_BACKEND to a backend")
    at = _nearest(sorted({r.M for r in pool}), M)
    here = [r for r in pool if r.M == at]
    best = min(here, key=lambda r: (r.t_ms, r.backend, r.slices, r.plan))
    arm = baseline_arm(table.world)[0]
    base_label = arm_label(arm)
    base = next((r for r in table.rows if (r.W, r.N, r.producer, r.M) == (W, N, producer, at)
                 and (r.backend, r.slices) == arm and r.correct), None)
    # "never slower than the base" holds because the base, where usable, is in ``here``
    where = f"M = {at}" if at == M else f"M = {at}, the nearest measured to {M}"
    reason = (f"fastest {accuracy if accuracy == 'exact' else 'exact or quantized'} of "
              f"{len(here)} measured at {where} (W = {W}, N = {N}): {best.t_ms:.3f} ms")
    if base is None:
        reason += f"; the base ({base_label}) was not measured there"
    else:
        reason += f"; the base ({base_label}) {base.t_ms:.3f} ms, {base.t_ms / best.t_ms:.2f}x"
        if base.accuracy not in classes:
            reason += f" (not a candidate: {base.accuracy})"
        elif base not in here:
            reason += " (not a candidate: not usable in this world)"
    return Choice(best.backend, best.slices, best.plan, best.schedule, at, best.t_ms, reason,
                  base_label, None if base is None else base.t_ms)


def measured_choices(table: TuningTable, W: int, N: int, producer: str, accuracy: str,
                     usable: Callable[[str], bool] = lambda name: True) -> list[Choice]:
    """The choice at every M the table measured for (W, N, producer), smallest M first
    (the vLLM installer's summary); ``ValueError`` as :func:`choose` where there is none."""
    ms = sorted({r.M for r in table.rows if (r.W, r.N, r.producer) == (W, N, producer)})
    return [choose(table, W, N, m, producer, accuracy, usable) for m in ms or [1]]
