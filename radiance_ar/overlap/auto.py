"""``RADIANCE_AR_BACKEND=auto`` in a runtime: per call, the configuration a tuning table
measured fastest, run by a runtime of its own (radiance_ar/overlap/tuning.py).

The auto runtime's own backend is the *contract* backend (``sdma``, which every world
kind serves): before its first sliced call, every rank makes one small all-reduce on it
whose signature carries the table's word (``CallSignature.tuning``). All ranks make that
call on the same backend whatever their tables say, so ranks that loaded different
tables (or ask for different accuracy classes) meet a :class:`CollectiveMismatchError`
there, on every rank, instead of running different protocols against each other. Where
the flags are device memory (torchrun GPUs) the host cannot read a peer's word, and a
mismatched wait would only time out: there the words go through the world's process
group instead (:meth:`AutoChoices.agree_through_group`). Every backend an auto runtime
builds carries the word in every call's signature too.

Calls below ``RADIANCE_AR_OVERLAP_MIN_M`` take the decode path on the auto runtime itself
(no choice, no agreement call: decode runs inside captured CUDA graphs). Each chosen
(backend, S, plan) gets a child runtime, built on first use (collective: the
choice is the same on every rank) and kept: at most one per distinct configuration in
the table. Children share the parent's layer numbers and scratch buffers; one call runs
at a time (the parent's lock).

Emulated ranks (one host thread drives every rank in order) build nothing inside a call:
rank 0's agreement call parks its stream on rank 1's flag before rank 1's call is even
enqueued, and building a child then (a backend's buffers, kernel loads, streams, a GEMM
shape's first launch) may synchronize the device, which waits forever on that parked
stream (the H200 session of 2026-12-04 hung so). There :meth:`AutoChoices.prepare` must
run for every rank and every call shape first (``EmulatedRanks.prepare``), and a call
whose child was not prepared raises ``ValueError`` before it enqueues anything.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from radiance_ar import backends
from radiance_ar.call_contract import CollectiveError, CollectiveMismatchError
from radiance_ar.overlap import tuning
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.streams import capturing

if TYPE_CHECKING:
    from radiance_ar.backends.interface import Backend
    from radiance_ar.overlap.runtime import OverlapRuntime
    from radiance_ar.transport.world import World

logger = logging.getLogger("radiance_ar")

#: the backend of the agreement call (module doc): exact, and served by every world kind
CONTRACT_BACKEND = "sdma"
#: the agreement call's width: one row of float32
_AGREE_COLS = 64

#: tables already announced as not measured here (the warning is said once per process)
_announced: set[str] = set()


def table_for(settings: OverlapSettings) -> tuning.TuningTable:
    """The table ``settings`` name (``tuning``; "": the shipped one), loaded and checked."""
    return tuning.load(settings.tuning) if settings.tuning else tuning.shipped()


def announce(table: tuning.TuningTable, device: str) -> None:
    """Once per process: say that the shipped table was not measured on this machine."""
    if table.shipped and table.digest not in _announced:
        _announced.add(table.digest)
        logger.warning("RADIANCE_AR_BACKEND=auto without RADIANCE_AR_TUNING: choosing from %s, "
                       "not measured on this machine (%s); run tools/tune.py here and set "
                       "RADIANCE_AR_TUNING to its file", table.describe(), device)


def usable_in(world: "World"):
    """``backend name -> whether its gate lets it serve world``."""
    return lambda name: backends.get(name).unsupported_reason(world) is None


class AutoChoices:
    """The auto runtime's table, its word, its per-shape choices and child runtimes."""

    def __init__(self, world: "World", settings: OverlapSettings, table: tuning.TuningTable):
        reason = tuning.schedule_reason(table, settings.backend_settings.sdma_schedule)
        if reason is not None:
            raise ValueError(reason)
        self.world, self.settings, self.table = world, settings, table
        usable = usable_in(world)
        #: the backends of the table this rank can run: ranks whose environments differ
        #: (bindings, Triton) would choose differently, so they go into the word
        self.usable = sorted({r.backend for r in table.rows if usable(r.backend)})
        self.word = table.signature_word(settings.accuracy, self.usable)
        self._choices: dict[tuple[int, int, str], tuning.Choice] = {}
        self._children: dict[tuple[str, int, str], "OverlapRuntime"] = {}
        self._agreed = False
        #: the agreement call's row (allocated before any call: emulated ranks' rule 1)
        self._agree_row: torch.Tensor | None = None

    def choice(self, rows: int, cols: int, producer: str) -> tuning.Choice:
        """:func:`tuning.choose` for this world, cached per (M, N, producer)."""
        key = (rows, cols, producer)
        if key not in self._choices:
            self._choices[key] = tuning.choose(self.table, self.world.size, cols, rows, producer,
                                               self.settings.accuracy, usable_in(self.world))
        return self._choices[key]

    def agree(self, parent: "OverlapRuntime") -> None:
        """Collective, once, before the first sliced call: the agreement (module doc)."""
        if self._agreed:
            return
        backend = parent.backend
        if backend.signals is not None and not backend.signals.host_visible:
            self.agree_through_group()
            self._agreed = True
            return
        one = self._grow_agreement(backend)
        one.zero_()
        backend.set_call_key(0, 0, 0)
        try:
            backend.all_reduce(one, one)
        except CollectiveError as e:
            theirs = self._other_words(backend)
            if not theirs:
                raise
            # The peer that saw the mismatch first gave up (PeerAbortedError here): name
            # the cause on this rank too, so every rank reports the same error.
            raise self._mismatch(theirs, f" ({type(e).__name__}: {e})") from e
        self._agreed = True

    def agree_through_group(self) -> None:
        """The agreement where flags live in device memory (torchrun GPUs): a wait there
        cannot be read by the host, so a mismatched agreement call would only time out.
        Every rank's word goes through the world's process group instead, and every rank
        raises the same :class:`CollectiveMismatchError` if they differ."""
        import torch.distributed as dist

        words: list = [None] * self.world.size
        dist.all_gather_object(words, self.word, group=self.world.group)
        theirs = [(r, w) for r, w in enumerate(words) if w != self.word]
        if theirs:
            raise self._mismatch(theirs, "")

    def _mismatch(self, theirs: list[tuple[int, int]], cause: str) -> CollectiveMismatchError:
        return CollectiveMismatchError(
            f"RADIANCE_AR_BACKEND=auto: rank {self.world.rank} chooses from "
            f"{self.table.describe()} with RADIANCE_AR_ACCURACY={self.settings.accuracy} "
            f"(word {self.word:#010x}); " + ", ".join(
                f"rank {r} from another table, accuracy or set of usable backends (word "
                f"{w:#010x})" for r, w in theirs)
            + f" (usable here: {', '.join(self.usable)}); every rank must load the same "
            "RADIANCE_AR_TUNING and RADIANCE_AR_ACCURACY, with the same backends usable"
            + cause)

    def _other_words(self, backend) -> list[tuple[int, int]]:
        """(rank, word) of every peer whose current call carries another tuning word, as
        its header shows (host-visible flags only; elsewhere none can be read)."""
        signals = backend.signals
        if signals is None or not signals.host_visible:
            return []
        out = []
        for peer in range(self.world.size):
            sig = signals.peer_header(peer)[1] if peer != self.world.rank else None
            if sig is not None and sig.tuning != self.word:
                out.append((peer, sig.tuning))
        return out

    def runtime_for(self, parent: "OverlapRuntime", rows: int, cols: int,
                    producer: str) -> "OverlapRuntime":
        """The child runtime of this call's choice (built on first use: collective), after
        the agreement call: ranks whose tables differ would build different backends, and
        a backend's construction is collective too. Emulated ranks: the child must have
        been prepared (module doc); checked before the agreement call is enqueued.
        Below ``min_m`` the parent itself: the decode path (GEMM, then the vendor
        all-reduce) chooses nothing, builds nothing and may run inside CUDA-graph capture."""
        if rows < self.settings.min_m:
            return parent
        choice = self.choice(rows, cols, producer)
        if ((_key(choice) not in self._children or not self._agreed)
                and capturing(self.world.device)):
            raise RuntimeError(
                f"RADIANCE_AR_BACKEND=auto: a call of {rows} x {cols} ({producer}) inside "
                f"CUDA-graph capture chooses {choice.backend} S={choice.slices} {choice.plan}, whose runtime "
                "was never built or agreed on: that is collective and loads kernels, which a "
                "capture cannot hold; run the shape once before capturing (vLLM's warm-up does)")
        if self.world.emulated and _key(choice) not in self._children:
            raise ValueError(
                f"RADIANCE_AR_BACKEND=auto, emulated rank {self.world.rank}: a call of {rows} x "
                f"{cols} ({producer}) chooses {choice.backend} S={choice.slices} {choice.plan}, "
                "whose runtime was not prepared; call rt.auto.prepare(rt, x, weight, "
                "weight_scale, producer) on every rank (EmulatedRanks.prepare) before the first "
                "call of each shape: built inside a call, it could synchronize the device while "
                "a peer's stream is parked (module doc)")
        self.agree(parent)
        return self._child(parent, choice)

    def prepare(self, parent: "OverlapRuntime", x: torch.Tensor, weight: torch.Tensor,
                weight_scale: torch.Tensor | None, producer: str) -> "OverlapRuntime":
        """Collective, no call made: everything the first call of ``x`` against ``weight``
        would build, built now (emulated ranks must do this for every rank before any
        rank's stream can park on a flag, the agreement call's included:
        radiance_ar/harness/emulated.py, rule 1): the choice's child runtime, its backend
        and the contract backend grown (their kernels loaded), the child's streams, and
        the GEMM of every slice shape of the call launched once. Returns the child (the
        parent below ``min_m``: the decode path builds nothing)."""
        from radiance_ar.overlap import producers
        from radiance_ar.overlap.slicing import op_bounds

        rows, cols = x.shape[0], weight.shape[0]
        if rows < self.settings.min_m:
            return parent
        child = self._child(parent, self.choice(rows, cols, producer))
        child.backend.ensure_capacity(rows, cols, x.dtype)
        self._grow_agreement(parent.backend)
        child.lanes()
        prod = producers.get(producer)
        bounds = op_bounds(child.settings, child.backend, rows, prod.slice_row_align)
        prod.warm_up(x, weight, weight_scale, bounds, child.scratch)
        return child

    def _grow_agreement(self, backend) -> torch.Tensor:
        """The agreement call's row, and the contract backend grown for it."""
        if self._agree_row is None:
            self._agree_row = torch.zeros(1, _AGREE_COLS, dtype=torch.float32,
                                          device=self.world.device)
        backend.ensure_capacity(1, _AGREE_COLS, self._agree_row.dtype)
        return self._agree_row

    def _child(self, parent: "OverlapRuntime", c: tuning.Choice) -> "OverlapRuntime":
        key = _key(c)
        if key not in self._children:
            settings = dataclasses.replace(self.settings, backend=c.backend, slices=c.slices,
                                           plan=c.plan)
            backend = backends.get(c.backend)(self.world, settings.backend_settings)
            backend.tuning_word = self.word
            # the parent's own class: this module builds no runtime of its own kind
            self._children[key] = type(parent)(self.world, settings, backend,
                                               scratch=parent.scratch, _layers=parent._layers)
        return self._children[key]

    def close(self) -> None:
        for child in self._children.values():
            child.close()
        self._children.clear()


def _key(c: tuning.Choice) -> tuple[str, int, str]:
    """A child runtime's key: what a choice configures (one child per configuration)."""
    return (c.backend, c.slices, c.plan)


def build_auto(world: "World", settings: OverlapSettings) -> tuple["Backend", AutoChoices]:
    """Collective: what the auto runtime for ``world`` holds (the table loaded and checked
    now, so a bad file stops start-up): its backend, the contract backend, and its choices
    (``radiance_ar.overlap.runtime.build`` makes the runtime of them)."""
    table = table_for(settings)
    announce(table, str(world.device) if world.device.type == "cpu"
             else torch.cuda.get_device_name(world.device))
    # The contract first: building it compares the ranks' shared settings (all raise if
    # they differ), so the table's schedule check below fails on every rank or on none.
    contract = backends.get(CONTRACT_BACKEND)(world, settings.backend_settings)
    try:
        choices = AutoChoices(world, settings, table)
    except BaseException:
        contract.close()
        raise
    contract.tuning_word = choices.word
    return contract, choices
