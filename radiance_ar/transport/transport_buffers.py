"""One rank's buffers of the copy-engine transport, and the routes of copies into and out of them.

Per rank (``capacity`` bytes each, one layout, so a call's bytes sit at the same offset
in every buffer)::

  pub    peer-visible: what this rank publishes for its peers to pull
  red    peer-visible, two-shot only: the reduced shards this rank publishes
  stage  device memory, host-memory worlds only: where this rank writes what it publishes
         (the publish is then a D2H copy of the stage into pub / red)
  recv   private device memory: W - 1 receive slots, one per peer

A call's copies are address arithmetic on routes decided once per growth (no tensor
view per step: host time); inside a graph capture the routes are those a graph can hold
(:meth:`TransportBuffers.in_graph`). Who writes and reads what, and when, is
:mod:`radiance_ar.transport.copy_transport`'s.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from radiance_ar.transport.copy_engine import CopyEngine, Route
from radiance_ar.transport.peer_memory import PeerBuffer
from radiance_ar.transport.world import World


class TransportBuffers:
    """The buffers of one rank (see the module doc). ``reduced``: allocate ``red``;
    ``stage_reduced``: in host-memory worlds give ``red`` a device stage too."""

    def __init__(self, world: World, engine: CopyEngine | None, peers: list[int], *,
                 reduced: bool, stage_reduced: bool):
        self.world, self.engine, self.peers = world, engine, peers
        #: buffers in host memory: publishes copy a device stage into them (D2H), pulls
        #: copy out of them (H2D); gpu-emulated and gpu-host
        self.staged = world.host_buffers
        self.reduced, self.stage_reduced = reduced, stage_reduced
        self.capacity = 0  # bytes of one buffer
        self.pub: PeerBuffer | None = None
        self.red: PeerBuffer | None = None
        self._stage: dict[str, torch.Tensor] = {}  # staged: device stages of pub / red
        self._recv: torch.Tensor | None = None  # W-1 private receive buffers
        #: (buffer, peer) -> (address of the peer's buffer, route of a pull from it)
        self.pull_routes: dict[tuple[str, int], tuple[int, Route]] = {}
        #: buffer -> (address of my part of it, route of a publish into it)
        self.publish_routes: dict[str, tuple[int, Route]] = {}

    def allocate(self, nbytes: int) -> None:
        """Collective: replace every buffer by one of ``nbytes`` (the caller has sized it
        and made sure no call is in flight); a failure leaves none and capacity 0."""
        self.close()
        try:
            self._allocate(nbytes)
        except BaseException:
            self.close()  # none held: a pub mapped (and registered) before red failed goes too
            raise

    def _allocate(self, nbytes: int) -> None:
        mem, dev, size = self.world.memory, self.world.device, self.world.size
        self.pub = mem.allocate("sdma.pub", nbytes)
        if self.reduced:
            self.red = mem.allocate("sdma.red", nbytes)
        if self.staged:
            self._stage["pub"] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            if self.red is not None and self.stage_reduced:
                self._stage["red"] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        if size > 1:
            self._recv = torch.empty((size - 1) * nbytes, dtype=torch.uint8, device=dev)
            for name, buf in (("pub", self.pub), ("red", self.red)):
                if buf is None:
                    continue
                # a publish copies this rank's device memory (like the receive buffer)
                self.publish_routes[name] = (buf.local.data_ptr(),
                                             self.engine.route(buf.local, self._recv))
                for p in self.peers:
                    self.pull_routes[name, p] = (buf.peer(p).data_ptr(),
                                                 self.engine.route(self._recv, buf.peer(p)))
        self.capacity = nbytes

    def source(self, buffer: str = "pub") -> torch.Tensor:
        """Where this rank writes the bytes it publishes in ``buffer`` (``"pub"`` or
        ``"red"``): its local bytes, or where the buffers are host memory its device
        stage (the publish then copies the stage into the buffer, D2H)."""
        stage = self._stage.get(buffer)
        if stage is not None:
            return stage
        return (self.pub if buffer == "pub" else self.red).local

    def _recv_offset(self, peer: int) -> int:
        """Where ``peer``'s private receive buffer starts in ``_recv`` (capacity bytes each)."""
        return (peer - self.world.rank - 1) % self.world.size * self.capacity  # slot 0..W-2

    def recv_slot(self, peer: int, nbytes: int, at: int = 0) -> torch.Tensor:
        """Bytes [at, at + nbytes) of ``peer``'s private receive buffer. A call receives at
        its own offset in ``pub`` (the buffers share one layout), so calls on disjoint
        bytes can be in flight together (:mod:`radiance_ar.transport.call_streams`)."""
        assert 0 <= at and at + nbytes <= self.capacity, (at, nbytes)
        start = self._recv_offset(peer) + at
        return self._recv[start:start + nbytes]

    def recv_address(self, peer: int, at: int = 0) -> int:
        """The address of byte ``at`` of ``peer``'s receive buffer (:meth:`recv_slot`, no view)."""
        return self._recv.data_ptr() + self._recv_offset(peer) + at

    def local_address(self, buffer: str) -> int:
        """The address of this rank's part of ``buffer`` (``"pub"`` or ``"red"``)."""
        return self.publish_routes[buffer][0]

    @contextlib.contextmanager
    def in_graph(self) -> Iterator[None]:
        """While a graph is captured: every route as a graph holds it
        (:meth:`Route.in_graph <radiance_ar.transport.copy_engine.Route.in_graph>`)."""
        eager, capacity = (self.pull_routes, self.publish_routes), self.capacity
        self.pull_routes = {k: (a, how.in_graph()) for k, (a, how) in eager[0].items()}
        self.publish_routes = {k: (a, how.in_graph()) for k, (a, how) in eager[1].items()}
        try:
            yield
        finally:
            # growth is refused in capture: the eager routes still point at these buffers
            assert self.capacity == capacity, (capacity, self.capacity)
            self.pull_routes, self.publish_routes = eager

    def close(self) -> None:
        """Drop every buffer (capacity 0)."""
        self.pub = self.red = self._recv = None
        self._stage.clear()
        self.pull_routes.clear()
        self.publish_routes.clear()
        self.capacity = 0
