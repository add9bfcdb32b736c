"""The process's overlap runtime: the world, the settings, the backends and the buffers.

``radiance::linear_ar`` is a torch custom op and cannot take Python objects, so the
state it needs lives here, set up once per process by :func:`configure` (the vLLM
installer calls it; tests and tools call it directly).
:func:`radiance_ar.overlap.op.forward` is the op's body with the runtime passed explicitly,
which lets one process drive several emulated ranks, each with its own runtime.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from radiance_ar import backends
from radiance_ar.backends.interface import Backend
from radiance_ar.buffers import keep_until_exit
from radiance_ar.envs import AUTO_BACKEND
from radiance_ar.transport.world import World, log_once
from radiance_ar.overlap.config import OverlapSettings, from_env, reconcile
from radiance_ar.overlap.graphs import GraphCache
from radiance_ar.overlap.lanes import Lanes
from radiance_ar.overlap.scratch import ScratchPool
from radiance_ar.streams import capturing, current_stream_handle, stream_object

#: the largest layer number a call signature carries (16 bits: CallSignature.words)
MAX_LAYER = (1 << 16) - 1


@dataclass
class OverlapRuntime:
    world: World
    settings: OverlapSettings
    backend: Backend  # the sliced path's all-reduce
    scratch: ScratchPool = field(default_factory=ScratchPool)
    _lanes: Lanes | None = None
    _stock: Backend | None = None
    _call_lock: threading.Lock = field(default_factory=threading.Lock)
    #: the thread of the first call: the only one whose calls are taken
    _owner: threading.Thread | None = None
    #: the raw handle of the stream the last call was enqueued on (GPU)
    _last_stream: int | None = None
    _graphs: GraphCache | None = None
    #: weight address -> the layer's number (:meth:`register_layer`)
    _layers: dict[int, int] = field(default_factory=dict)
    #: a sliced call's plan and signature by its operands, layer number included (the
    #: op's memo: :meth:`remember_sliced_call`)
    sliced_calls: dict[tuple, Any] = field(default_factory=dict)
    #: RADIANCE_AR_BACKEND=auto: the table and the chosen configurations' runtimes
    #: (radiance_ar/overlap/auto.py); None: every call runs ``backend``
    auto: Any = None

    def __post_init__(self) -> None:
        self.scratch.open(self.world.device)  # rule 1 of emulated ranks (ScratchPool.open)

    def for_call(self, rows: int, cols: int, producer: str) -> "OverlapRuntime":
        """The runtime that runs a call of ``rows`` x ``cols`` with ``producer``: this one,
        or under ``auto`` its choice's (collective on first use)."""
        return self if self.auto is None else self.auto.runtime_for(self, rows, cols, producer)

    def register_layer(self, weight: torch.Tensor) -> int:
        """Number the layer whose weight (this rank's shard) is ``weight``: 1, 2, ... in
        the order of registration, which every rank must share (the vLLM installer
        registers layers in model order). Its calls' signatures carry the number, so a
        rank that skipped a replayed op call meets a mismatch at the next layer."""
        number = self._layers.get(weight.data_ptr(), len(self._layers) + 1)
        if number > MAX_LAYER:
            raise ValueError(f"register_layer: layer {number}: a signature carries layer numbers "
                             f"up to {MAX_LAYER} (16 bits)")
        self._layers[weight.data_ptr()] = number
        return number

    def remember_sliced_call(self, operands: tuple, call: Any) -> Any:
        """Keep ``call`` (the op's plan and signature of a sliced call) for ``operands``;
        the memo starts over past as many entries as the graph cache remembers keys."""
        if len(self.sliced_calls) >= GraphCache.SEEN_KEYS:
            self.sliced_calls.clear()
        self.sliced_calls[operands] = call
        return call

    def layer_number(self, weight: torch.Tensor) -> int:
        """The number :meth:`register_layer` gave ``weight``'s layer (0: not registered)."""
        return self._layers.get(weight.data_ptr(), 0)

    def graph_reason(self) -> str | None:
        """``None`` if the op replays captured sliced calls here, else why not."""
        if self.settings.graphs == "off":
            return "RADIANCE_AR_OP_GRAPHS=off"
        return self.backend.replay_reason(forced=self.settings.graphs == "on")

    def caller_capture_reason(self) -> str | None:
        """``None`` if the sliced path may run inside a caller's CUDA-graph capture here,
        else why not (:meth:`Backend.caller_capture_reason`)."""
        return self.backend.caller_capture_reason(self.settings.graphs)

    @contextlib.contextmanager
    def caller_capture_round(self, sig: Any) -> Iterator[None]:
        """Around one sliced op call (signature ``sig``) captured by a caller: the
        backend's round; afterwards the scratch buffers are held too (they may not grow)."""
        with self.backend.caller_capture_round(sig):
            yield
        self.scratch.held = True

    def graphs(self) -> GraphCache | None:
        """The op's captured sliced calls (:mod:`radiance_ar.overlap.graphs`), or None
        where each call is enqueued step by step (:meth:`graph_reason`)."""
        reason = self.graph_reason()
        if reason is not None:
            # a warning where RADIANCE_AR_OP_GRAPHS=on asked for replays
            log_once(logging.WARNING if self.settings.graphs == "on" else logging.INFO,
                     f"radiance-ar op graphs: sliced calls enqueued step by step, not "
                     f"replayed: {reason}")
            return None
        if self._graphs is None:
            self._graphs = GraphCache(self.world.device, self.settings.graphs_per_layer)
        return self._graphs

    @property
    def stock(self) -> Backend:
        """The decode path's all-reduce (and the unsliced baseline's): the vendor collective.

        Built on first use, so a world without a vendor collective (the emulated one) can
        still run the sliced path; using the decode path there raises the stock gate's reason.
        """
        if self._stock is None:
            self._stock = (self.backend if self.backend.name == "stock"
                           else backends.get("stock")(self.world, self.settings.backend_settings))
        return self._stock

    def stock_reason(self) -> str | None:
        """Why the vendor collective cannot serve this world (None: it can)."""
        return backends.get("stock").unsupported_reason(self.world)

    @contextlib.contextmanager
    def one_call_at_a_time(self) -> Iterator[None]:
        """The op's calls are collective and ordered: they come from one thread, the first
        call's (two threads, even taking turns, could order their calls differently on
        each rank, and equal signatures would pair the wrong calls), and on GPU each call
        is ordered after the last one's work (:meth:`_after_last_stream`). Another thread
        is refused at once (it does not wait), and the refusal faults the backend as a
        failed call does: a peer that made the call this rank refused raises too (the
        abort word, else its bound), and every call is refused until resync."""
        me = threading.current_thread()
        if self._owner is not None and self._owner is not me:
            self._refuse(f"thread {me.name!r} called the op, whose calls on this runtime "
                         f"come from thread {self._owner.name!r}")
        if not self._call_lock.acquire(blocking=False):  # two threads' first calls at once
            self._refuse(f"thread {me.name!r} entered the op while another thread's first "
                         "call is in flight on this runtime")
        try:
            self._owner = self._owner or me
            self._after_last_stream()
            yield
        finally:
            self._call_lock.release()

    def _refuse(self, what: str) -> None:
        error = RuntimeError(
            f"radiance::linear_ar: {what}; calls are collective and must come from one thread "
            "per rank, in one order (to call from another thread, build the runtime again on "
            "every rank); this rank's calls are refused until resync")
        self.backend.fault(error)
        raise error

    def _after_last_stream(self) -> None:
        """A call from another stream than the last call's: that stream first waits for
        the last one's work. Every call shares the scratch pool, the backend's buffers and
        the graphs' persistent inputs and outputs, used without record_stream, so their
        uses must stay in one order on the device. Not inside a caller's capture (a captured
        stream may wait for no work outside it; the graph's order is the caller's)."""
        device = self.world.device
        if device.type != "cuda":
            return
        stream = current_stream_handle(device)
        if stream == self._last_stream:
            return
        if capturing(device):
            return
        if self._last_stream is not None:
            stream_object(stream, device).wait_stream(stream_object(self._last_stream, device))
        self._last_stream = stream

    def lanes(self) -> Lanes:
        # Created on the first sliced call only: the decode path never touches streams.
        if self._lanes is None:
            self._lanes = Lanes(self.world.device)
        return self._lanes

    def close(self) -> None:
        if self.auto is not None:
            self.auto.close()
        if self._graphs is not None:
            self._graphs.clear()
        if self.scratch.held:
            keep_until_exit(self.scratch, "the op's scratch pool closed")
        self.backend.close()
        if self._stock is not None and self._stock is not self.backend:
            self._stock.close()


class ProcessRuntime:
    """The one runtime the op uses in this process, and its lifetime.

    - Who builds it: :meth:`configure` (collective over the world's ranks). The vLLM
      installer calls it once per process on vLLM's TP group; tests and tools call
      :func:`overlap.configure` directly.
    - ``configure`` twice: with the same ``key`` and settings it returns the runtime it
      has (the installer runs once per model load, possibly more than once); otherwise it
      closes the runtime it has (collective where its memory is) and builds a new one.
    - Who closes it: :meth:`shutdown` (collective), or the next ``configure``. A process
      that exits without either releases its memory with the process.
    """

    def __init__(self) -> None:
        self._runtime: OverlapRuntime | None = None
        self._key: tuple[Any, OverlapSettings | None] | None = None

    def is_configured_for(self, key: Any, settings: OverlapSettings | None) -> bool:
        return self._runtime is not None and self._key == (key, settings)

    def configure(self, world: World, settings: OverlapSettings | None = None,
                  key: Any = None) -> OverlapRuntime:
        if key is not None and self.is_configured_for(key, settings):
            return self._runtime
        self.shutdown()
        self._runtime = build(world, settings)
        self._key = (key, settings)
        return self._runtime

    def current(self) -> OverlapRuntime:
        if self._runtime is None:
            raise RuntimeError("radiance::linear_ar has no runtime in this process: call "
                               "overlap.configure(world) first (the vLLM installer does)")
        return self._runtime

    def shutdown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        self._runtime, self._key = None, None


#: the op's state in this process (a torch custom op takes no Python objects)
PROCESS = ProcessRuntime()


def build(world: World, settings: OverlapSettings | None = None) -> OverlapRuntime:
    """Collective: a runtime for ``world`` (settings default to the environment's); the
    backend is built with ``settings.backend_settings``."""
    settings = from_env() if settings is None else reconcile(settings)
    if settings.backend == AUTO_BACKEND:
        from radiance_ar.overlap.auto import build_auto
        contract, choices = build_auto(world, settings)
        return OverlapRuntime(world, settings, contract, auto=choices)
    backend = backends.get(settings.backend)(world, settings.backend_settings)
    return OverlapRuntime(world, settings, backend)


def configure(world: World, settings: OverlapSettings | None = None) -> OverlapRuntime:
    """Collective: build this process's runtime and make the op use it (closing any
    earlier one: see :class:`ProcessRuntime`)."""
    return PROCESS.configure(world, settings)


def current() -> OverlapRuntime:
    return PROCESS.current()


def shutdown() -> None:
    """Collective: close this process's runtime; the op refuses until ``configure``."""
    PROCESS.shutdown()
