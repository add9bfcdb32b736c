"""The contract every all-reduce backend fulfils (docs/design.md, 'The Backend interface').

A backend is built for one rank of a :class:`~radiance_ar.transport.world.World` and sums a
contiguous 2-D slice over all ranks::

    out = sum(slice_in on rank r for r in range(world.size))   # plain-torch meaning

``all_reduce`` runs on the caller's current stream, never synchronizes the host and
allocates nothing per call. It is *collective*: every rank calls it the same number of
times, in the same order, with the same shapes. Backends with a protocol of their own
check that contract on every call (:mod:`radiance_ar.call_contract`): a mismatch, a late
or missing peer raises on every rank that sees it, and every later call is refused
until ``resync()``.
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, Callable, ClassVar, Hashable, Iterator

import torch
import torch.distributed as dist

from radiance_ar.call_contract import CallSignature
from radiance_ar.envs import BackendSettings
from radiance_ar.transport.world import World

if TYPE_CHECKING:
    from radiance_ar.transport.signals import Signals
    from radiance_ar.transport.trace import StepTrace

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_slice(slice_in: torch.Tensor, out: torch.Tensor) -> None:
    """Caller-facing checks shared by every backend's ``all_reduce``."""
    for label, t in (("slice_in", slice_in), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"all_reduce: {label} must be 2-D (rows, cols), got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"all_reduce: {label} must be contiguous")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"all_reduce: {label} dtype {t.dtype} not in {SUPPORTED_DTYPES}")
    if slice_in.shape != out.shape or slice_in.dtype != out.dtype:
        raise ValueError(
            f"all_reduce: out {tuple(out.shape)} {out.dtype} must match slice_in "
            f"{tuple(slice_in.shape)} {slice_in.dtype}")
    if slice_in.device != out.device:
        raise ValueError(f"all_reduce: slice_in on {slice_in.device} but out on {out.device}")


def check_capacity_args(who: str, max_rows: int, cols: int, dtype: torch.dtype) -> None:
    """The checks of ``ensure_capacity``'s arguments: ``max_rows`` and ``cols`` ints >= 1,
    ``dtype`` one of :data:`SUPPORTED_DTYPES`. ``who`` names the backend in the message."""
    for label, v in (("max_rows", max_rows), ("cols", cols)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{who}.ensure_capacity: {label} must be an int >= 1, got {v!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{who}.ensure_capacity: dtype {dtype}, expected one of "
                        f"{SUPPORTED_DTYPES}")


def settings_disagreement(fields: tuple[str, ...], per_rank: list) -> str | None:
    """Why ranks whose ``BackendSettings`` are ``per_rank`` cannot run one backend together:
    the ``fields`` whose values differ, each with its variable and every rank's value
    (None: they agree). Pure, so CPU tests check the message."""
    differ = [f for f in fields if len({repr(getattr(s, f)) for s in per_rank}) > 1]
    if not differ:
        return None
    return "; ".join(f"{BackendSettings.KNOB_OF[f]} differs between ranks ("
                     + ", ".join(f"rank {r}: {getattr(s, f)!r}" for r, s in enumerate(per_rank))
                     + ")" for f in differ) + ": every rank must set it alike"


def copy_unless_same(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[...] = src`` unless both are the same memory (an in-place call)."""
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


class Backend(abc.ABC):
    """One rank's all-reduce strategy. Subclasses register with ``@backends.register``.

    Built as ``cls(world, settings)`` for one rank of ``world``; ``settings`` (a
    :class:`~radiance_ar.envs.BackendSettings`) holds every backend knob, and defaults to
    the environment's, read once here. A backend reads its knobs from ``self.settings``.
    """

    name: ClassVar[str]
    #: the transport holds compute units (CTAs/workgroups) while it waits for peers
    uses_compute_units_while_waiting: ClassVar[bool]
    #: may run inside CUDA-graph capture (after ensure_capacity ran outside it)
    capture_safe: ClassVar[bool]
    #: result equals the fp32-accumulated sum rounded once, same bits on every rank
    bit_exact: ClassVar[bool]
    #: documented bound on the relative RMS error of the reduced bf16 result vs a float64
    #: sum of the (already bf16-rounded) inputs; the compare tool marks a run wrong above it
    rel_rms_bound: ClassVar[float] = 2.0 ** -7
    #: the payload is quantized on the wire (RADIANCE_AR_ACCURACY's class ``quantized``:
    #: ``auto`` chooses it only when asked to); False: the inputs' values are summed as given
    quantized: ClassVar[bool] = False
    #: False: the op runs GEMM then one unsliced AR with this backend (the baseline)
    pipelined: ClassVar[bool] = True
    #: the slice count the op runs with RADIANCE_AR_OVERLAP_SLICES=auto, chosen from
    #: measurements each backend cites; 1 runs GEMM then one AR. The default 4 is the op's
    #: fixed S before ``auto`` (not measured per backend: symm_oneshot, symm_twoshot)
    preferred_slices: ClassVar[int] = 4
    #: the producer GEMM writes straight into ``acquire_input_view`` (peer-visible memory)
    peer_visible_input: ClassVar[bool] = False
    #: its calls wait for peers through flags of its own, bounded by
    #: ``settings.spin_timeout_ms`` (tests give such backends the misuse scenarios)
    waits_on_peers: ClassVar[bool] = False

    #: a caller's CUDA graph captured calls of this backend: its buffers may not grow, and
    #: ``close`` keeps them until the process exits (radiance_ar.buffers.keep_until_exit)
    held: bool = False
    #: the cross-rank flags of a backend with a protocol of its own (None: the vendor's)
    signals: "Signals | None" = None
    #: ``BackendSettings`` fields every rank must set alike, because they decide which
    #: bytes and flags a call moves; checked across the ranks when the backend is built
    shared_settings: ClassVar[tuple[str, ...]] = ()

    def __init__(self, world: World, settings: BackendSettings | None = None):
        reason = self.unsupported_reason(world)
        if reason is not None:
            raise ValueError(f"backend {self.name!r} cannot run here: {reason}")
        self.world = world
        #: the backend knobs (validated when the settings were built); read nothing else
        self.settings = self.settings_or_env(settings)
        self._check_settings_agree()
        #: (M, K, layer) of the linear whose slices are being reduced (:meth:`set_call_key`);
        #: it joins every call's signature, so ranks in different linears do not pair up
        self._call_key: tuple[int, int, int] = (0, 0, 0)
        #: RADIANCE_AR_BACKEND=auto: the tuning word every call's signature carries
        #: (``CallSignature.tuning``; set by the auto runtime that built this backend)
        self.tuning_word = 0

    @classmethod
    def settings_or_env(cls, settings: BackendSettings | None) -> BackendSettings:
        """``settings``, or the environment's where None; ``TypeError`` for anything else."""
        if settings is None:
            return BackendSettings.from_env()
        if not isinstance(settings, BackendSettings):
            raise TypeError(f"backend {cls.name!r}: settings must be a "
                            f"radiance_ar.envs.BackendSettings, got {type(settings).__name__}")
        return settings

    def _check_settings_agree(self) -> None:
        """Collective where the ranks are processes (``world.group``): ``ValueError`` on
        every rank if they set a :attr:`shared_settings` field differently. Ranks set so
        would pair up calls that move different bytes (a one-shot rank reading a whole
        peer input where a two-shot peer published a reduced shard): a wrong sum, or a
        wait no flag ends. Emulated ranks share one process and its settings."""
        if not self.shared_settings or self.world.group is None or self.world.size == 1:
            return
        per_rank: list = [None] * self.world.size
        dist.all_gather_object(per_rank, self.settings, group=self.world.group)
        reason = settings_disagreement(self.shared_settings, per_rank)
        if reason is not None:
            raise ValueError(f"backend {self.name!r} on rank {self.world.rank}: {reason}")

    def set_call_key(self, rows: int, k: int, layer: int = 0) -> None:
        """The op, before a call's slices: M and K of the whole linear and the layer's
        registered number (0: none), which every slice's signature then carries."""
        self._call_key = (rows, k, layer)

    def signature(self, slice_in: torch.Tensor, path: str = "flags") -> CallSignature:
        """What every rank must agree on for a call reducing ``slice_in``."""
        return CallSignature(slice_in.shape[0], slice_in.shape[1], slice_in.dtype, path,
                             *self._call_key, tuning=self.tuning_word)

    @contextlib.contextmanager
    def vendor_call(self, t: torch.Tensor) -> Iterator[None]:
        """Wrap the decode path's vendor all-reduce of ``t``: where this backend's flags
        are host memory, announce it to the peers (a peer in the sliced path then raises
        and releases this rank instead of leaving it blocked) and afterwards raise if a
        peer gave up meanwhile. Elsewhere (device flags, graph capture) a no-op."""
        signals = self.signals
        if signals is not None:
            signals.announce_vendor_call(self.signature(t, "vendor"))
        yield
        if signals is not None:
            signals.check_vendor_call()

    @classmethod
    def preferred_slices_for(cls, world_size: int, rows: int, plan: str) -> int:
        """The slice count of RADIANCE_AR_OVERLAP_SLICES=auto for an op call of ``rows``
        rows cut by ``plan`` in a world of ``world_size`` ranks (``preferred_slices``
        unless a backend measured otherwise per size, rows or plan)."""
        return cls.preferred_slices

    @classmethod
    def unsupported_reason(cls, world: World) -> str | None:
        """Pure gate: ``None`` if this backend can serve ``world``, else the reason why not."""
        return None

    @classmethod
    def unsupported_cols_reason(cls, cols: int) -> str | None:
        """Pure gate on the width of the reduced tensor: ``None`` if this backend can
        reduce rows of ``cols`` values, else why not (the vLLM installer asks it, so a
        layer the backend would refuse at its first prefill stays stock)."""
        return None

    @abc.abstractmethod
    def all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor) -> None:
        """Collective. ``out[...] = sum over ranks of slice_in`` on the current stream."""

    def encode_ahead(self, slice_in: torch.Tensor, row0: int) -> object | None:
        """The op, on the GEMM's stream right after GEMM slice ``slice_in`` (rows
        ``row0:row0 + len(slice_in)`` of the call): the first step of its all-reduce where
        that step reads only this rank's slice and writes only this rank's private memory,
        so no fence orders it; returns what :meth:`all_reduce_ahead` takes, or ``None``
        (nothing is done ahead: the op calls :meth:`all_reduce`). Why: a step the
        all-reduce's stream enqueues after the GEMM slice waits for the next GEMM slice's
        SMs (a persistent GEMM frees none until it ends)."""
        return None

    def all_reduce_ahead(self, slice_in: torch.Tensor, out: torch.Tensor,
                         ahead: object) -> None:
        """Collective. :meth:`all_reduce` of ``slice_in`` whose first step
        :meth:`encode_ahead` did (``ahead``: what it returned)."""
        raise TypeError(f"backend {self.name!r} does nothing ahead of its all-reduce")

    @abc.abstractmethod
    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        """Bytes this rank sends per call of ``numel`` values of ``elem_size`` bytes."""

    def call_schedule(self, rows: int, cols: int, dtype: torch.dtype) -> str | None:
        """The schedule a call on a ``rows x cols`` slice of ``dtype`` runs (``auto``
        resolved), for reports; None for a backend with one way of doing a call."""
        return None

    def ensure_capacity(self, max_rows: int, cols: int, dtype: torch.dtype) -> None:
        """Collective. Grow peer-visible buffers to hold ``max_rows x cols``; refuses in capture."""

    def acquire_input_view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """Acquire the peer-visible input buffer for the next op call and return its
        ``rows x cols`` view, which the producer writes into (``peer_visible_input`` only).
        Enqueues, on the current stream, the wait until every peer finished reading what
        the previous call left there (a cross-rank fence, no host sync)."""
        raise TypeError(f"backend {self.name!r} has no peer-visible input buffer")

    def fill_passive_peers(self) -> None:
        """Timing mode of an emulated world: make every other rank a passive peer whose
        payloads and flags for all future calls are already in host memory, so one active
        rank can be timed alone (docs/design.md, 'Worlds'). Results are then not sums over ranks."""
        raise TypeError(f"backend {self.name!r} has no passive-peer timing mode")

    def check(self, timeout_ms: float | None = None) -> None:
        """Host-side wait, bounded, for every call enqueued so far; raises
        :class:`~radiance_ar.transport.signals.PeerTimeoutError` naming a peer that never arrived. A
        backend whose waits are inline (CPU worlds) or bounded by the vendor collective
        has nothing to wait for here."""

    @contextlib.contextmanager
    def checking_call(self) -> Iterator[None]:
        """Around a call's checks of its arguments, before it takes a number: one that fails
        skips the call on this rank, so it faults the rank as a failed call does
        (:meth:`fault`): a peer that makes the call raises instead of pairing it with this
        rank's next, and this rank's calls are refused until :meth:`resync`."""
        try:
            yield
        except Exception as e:
            self.fault(e)
            raise

    def fault(self, error: BaseException) -> None:
        """Enter the fault state after ``error``: calls refused until :meth:`resync`, and
        the peers told where the flags carry an abort word (``signals.fail``)."""
        if self.signals is not None:
            self.signals.fail(error)

    def resync(self) -> None:
        """Collective, after a :class:`~radiance_ar.transport.signals.PeerTimeoutError` on any rank and
        with no call in flight: put every rank's call numbering back in step, so that the
        next call is right again. A backend without epochs of its own has nothing to put
        back (``stock``: a process group that timed out is not repaired here; build a
        fresh world)."""

    def replay_reason(self, forced: bool = False) -> str | None:
        """``None`` if the op may capture its sliced calls on this backend into CUDA graphs
        and replay them (:mod:`radiance_ar.overlap.graphs`), else why not. ``forced``
        (``RADIANCE_AR_OP_GRAPHS=on``) lifts what ``auto`` declines only for caution."""
        return f"backend {self.name!r} has no replayable calls"

    @property
    def generation(self) -> Hashable:
        """What a captured op call of this backend bakes in and what moves it (buffer
        sizes, resyncs): a captured call of another generation is captured again."""
        return ()

    def capture_round(self, end: Callable[[], None]) -> contextlib.AbstractContextManager:
        """While the op captures one call's sliced path (see :meth:`replay_reason`); once
        the round has begun, its end calls ``end()`` (``CUDAGraph.capture_end``) on every
        path, so that what the round marked is undone if ending the capture fails (a round
        that never began leaves the capture to its caller to end)."""
        raise TypeError(self.replay_reason())

    def caller_capture_reason(self, graphs: str) -> str | None:
        """``None`` if the op's sliced path may run inside a caller's CUDA-graph capture
        with this backend, else why not (``graphs``: RADIANCE_AR_OP_GRAPHS). Default: what
        ``capture_safe`` says."""
        return None if self.capture_safe else "its calls are not capture-safe"

    @contextlib.contextmanager
    def caller_capture_round(self, sig: CallSignature) -> Iterator[None]:
        """Around one op call of signature ``sig`` captured by a caller (allowed by
        :meth:`caller_capture_reason`). Afterwards the buffers are ``held``: the caller's
        graph replays their addresses, so they may not grow."""
        yield
        self.held = True

    def replay_call(self, sig: CallSignature,
                    captured: object) -> contextlib.AbstractContextManager:
        """Collective: around one replay of a graph captured in :meth:`capture_round`
        (which returned ``captured``) for an op call of ``sig``, launched inside on the
        current stream, which this may change (the caller's stream is ordered after the
        replay when the block ends)."""
        raise TypeError(self.replay_reason())

    def overlapped_calls(self) -> contextlib.AbstractContextManager:
        """A block of ``all_reduce`` calls that may run at the same time (the op's slices):
        inside it a call's ``out`` may be written after the call returns; when the block
        ends, the current stream is ordered after every call made in it. Calls that share
        bytes still run in turn. In plain torch nothing changes: every ``out`` holds its
        sum once the block is over. Default: every call is ordered on return."""
        return contextlib.nullcontext()

    def start_trace(self) -> StepTrace | None:
        """GPU: record device events around each step (wait, copy, kernel) of the calls
        that follow, until :meth:`stop_trace`; returns the trace, or None where the
        backend has no steps of its own to show (its AR is one opaque call)."""
        return None

    def stop_trace(self) -> None:
        """End what :meth:`start_trace` began (nothing where it returned None)."""

    def close(self) -> None:
        """Release peer-visible memory; collective where the world's memory is."""
