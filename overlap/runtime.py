"""The process's overlap runtime: the world, the settings, the backends and the buffers.

``radiance::linear_ar`` is a torch custom op and cannot take Python objects, so the
state it needs lives here, set up once per process by :func:`configure` (the vLLM
installer calls it; tests and tools call it directly). :func:`forward` is the op's
body with the runtime passed explicitly, which lets one process drive several emulated
ranks, each with its own runtime.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator


import backends
from backends.interface import Backend
from backends.world import World
from overlap.config import OverlapSettings, from_env
from overlap.lanes import Lanes
from overlap.scratch import ScratchPool


@dataclass
class OverlapRuntime:
    world: World
    settings: OverlapSettings
    backend: Backend  # the sliced path's all-reduce
    scratch: ScratchPool = field(default_factory=ScratchPool)
    _lanes: Lanes | None = None
    _stock: Backend | None = None
    _call_lock: threading.Lock = field(default_factory=threading.Lock)
    _call_thread: str | None = None

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
        """The op's calls are collective and ordered; two threads interleaving calls on
        one runtime would pair the wrong calls across ranks. A second thread entering
        while a call is in flight raises (it does not wait: its call would be ordered
        by chance, not by program order, across ranks)."""
        if not self._call_lock.acquire(blocking=False):
            raise RuntimeError(
                f"radiance::linear_ar: thread {threading.current_thread().name!r} entered the "
                f"op while thread {self._call_thread!r} has a call in flight on this runtime; "
                "calls are collective and must come from one thread per rank, in one order")
        self._call_thread = threading.current_thread().name
        try:
            yield
        finally:
            self._call_thread = None
            self._call_lock.release()

    def lanes(self) -> Lanes:
        # Created on the first sliced call only: the decode path never touches streams.
        if self._lanes is None:
            self._lanes = Lanes(self.world.device)
        return self._lanes

    def close(self) -> None:
        self.backend.close()
        if self._stock is not None and self._stock is not self.backend:
            self._stock.close()


_current: OverlapRuntime | None = None


def build(world: World, settings: OverlapSettings | None = None) -> OverlapRuntime:
    """Collective: a runtime for ``world`` (settings default to the environment's); the
    backend is built with ``settings.backend_settings``."""
    settings = from_env() if settings is None else settings
    backend = backends.get(settings.backend)(world, settings.backend_settings)
    return OverlapRuntime(world, settings, backend)


def configure(world: World, settings: OverlapSettings | None = None) -> OverlapRuntime:
    """Collective: build this process's runtime and make the op use it."""
    global _current
    if _current is not None:
        _current.close()
    _current = build(world, settings)
    return _current


def current() -> OverlapRuntime:
    if _current is None:
        raise RuntimeError("radiance::linear_ar has no runtime in this process: call "
                           "overlap.configure(world) first (the vLLM installer does)")
    return _current
