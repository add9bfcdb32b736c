"""The copy-engine transport: peer-visible buffers, flags, the reuse fence, publishes and pulls.

One rank's half of a transport that moves bytes with DMA copies (:mod:`radiance_ar.transport.copy_engine`)
and waits with flags (:mod:`radiance_ar.transport.signals`): no compute units while it waits
on NVIDIA (on ROCm one work-item per wait: :mod:`radiance_ar.transport.hip_ops`). The
backends built on it (``sdma``, ``sdma_wht6``) each hold one :class:`CopyTransport` and
decide what is published, what is pulled and what is computed from it. In plain terms,
rank r's ``publish`` is ``pub[r][off:off+n] = src; ready[r] = t`` and its ``pull`` of
peer p is ``wait until ready[p] == t; dst[:] = pub[p][off:off+n]``. The buffers and the
routes of copies between them are ``self.buffers`` (:mod:`radiance_ar.transport.transport_buffers`).

One call of rank r (epoch t; every rank numbers calls alike), on the caller's stream or
on one of two call streams entered from it (:mod:`radiance_ar.transport.call_streams`; in the
host-memory worlds the publishes, and a pipeline's last decodes, run beside it:
:mod:`radiance_ar.transport.side_lanes`)::

  rank r stream : [fence] publish ready_r=t  wait ready_p==t  pull p   done_r=t  compute
  rank p stream :         publish ready_p=t  wait ready_r==t  pull r   done_p=t  compute
                                    |________________________^

A second round (two-shot) publishes into ``red`` and posts ``reduced``; ``done`` is
posted after the last pull of the call, whichever buffer it read.

Buffer reuse (why ``done`` exists). Rank r's NEXT write into bytes of ``pub`` that a
peer may still be pulling (its next GEMM into the input buffer, or the next publish /
staging copy of an overlapping byte range) must wait until that peer finished::

  rank r : AR(t) ready_r=t ... done_r=t | fence: wait done_p>=t | GEMM(t+1) writes pub
  rank p :    wait ready_r==t  pull r(t) ---------------> done_p=t  |
                                 ^ a GEMM(t+1) here without the wait would corrupt p's pull

The fence is a stream wait-value (no host sync); each call's byte range of ``pub`` is
kept with its epoch (:meth:`CopyTransport.finish`) and :meth:`CopyTransport.fence` waits
for the newest overlapping one. ``red`` mirrors ``pub``'s layout (a call's shards lie
inside its ``pub`` range) and is written after that call's fence, so the same fence
covers it. The receive buffers are private and stream-ordered.

Worlds (docs/design.md, 'Worlds'): in ``gpu-emulated`` and ``gpu-host`` buffers and flags
are host memory: a rank publishes from a private device ``stage`` D2H and pulls H2D. Emulated
ranks share one host thread: a backend loads its kernels in ``ensure_capacity``, on every
rank, before any stream can park (:mod:`radiance_ar.harness.emulated`, rule 1).

Epochs are host integers passed by value, so a captured graph would replay stale ones: a
graph of op calls is captured in a token round instead (:meth:`CopyTransport.capture_round`,
:mod:`radiance_ar.transport.tokens`), with one-use tokens of fixed values.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from radiance_ar.call_contract import CallSignature
from radiance_ar.transport.call_streams import CallStreams, Footprint, OwnStream
from radiance_ar.transport.copy_engine import CopyEngine, copy_bytes, platform
from radiance_ar.transport.gpu_signals import GpuSignals
from radiance_ar.streams import current_stream_handle
from radiance_ar.buffers import grown_size, refuse_growth_in_capture
from radiance_ar.transport.side_lanes import DecodeLane, SideLane
from radiance_ar.transport.signals import FLAG_BYTES, CpuSignals, Signals
from radiance_ar.transport import tokens
from radiance_ar.transport.tokens import TokenRound, inbox_bytes
from radiance_ar.transport.trace import StepTrace, traced
from radiance_ar.transport.transport_buffers import TransportBuffers
from radiance_ar.transport.world import World

MAX_PENDING = 64  # reuse-fence entries kept before a fence waits for the newest
BUFFER_ALIGN = 256  # capacity in whole units: every receive slot 16-byte aligned for vectors


class CopyTransport:
    """One rank's copy-engine transport (see the module doc).

    ``owner`` names the backend in messages; ``reduced``: allocate the second
    peer-visible buffer ``red`` (two-shot); ``stage_reduced``: where buffers are host memory
    also give ``red`` a device stage (a backend that computes the reduced bytes into device
    memory before publishing them; ``sdma`` publishes its reduced shard from ``out``);
    ``call_streams``: 1 or 2 streams the calls entered through :meth:`on_call_stream` run
    on (:mod:`radiance_ar.transport.call_streams`); ``decode_lane``: in host-memory worlds
    keep a decode lane (:meth:`decode_beside`).
    """

    def __init__(self, world: World, owner: str, timeout_ms: float, *, reduced: bool,
                 stage_reduced: bool = False, call_streams: int = 1, decode_lane: bool = False):
        self.world, self.owner = world, owner
        size = world.size
        self.engine = CopyEngine(world.device) if size > 1 else None
        #: host-memory worlds: publishes (D2H) on their own stream, beside the pulls (H2D).
        #: Without it gpu-host's sdma ran at 0.46-0.51 of the link against 0.85-0.90
        #: emulated (H200, tools/results/2026-12-04-h200-gpu-host-second/), while its
        #: registered memory copies at the pinned memory's rate both ways (53.5 GB/s)
        staged_peers = world.host_buffers and size > 1
        self.lane = SideLane(world.device, steps=2) if staged_peers else None
        #: host-memory worlds: the kernels that end a call of an overlapped block
        #: (:meth:`decode_beside`)
        self.decode_lane = (DecodeLane(world.device, self._caller_stream)
                            if staged_peers and decode_lane else None)
        self.signals: Signals | None = None
        if size > 1:
            flags = world.memory.allocate("sdma.flags", FLAG_BYTES)
            dead = world.memory.dead_peers
            self.signals = (CpuSignals(flags, world.rank, size, timeout_ms, owner, dead)
                            if platform(world.device) == "cpu" else
                            GpuSignals(flags, world.rank, size, timeout_ms, self.engine, owner,
                                       dead))
            if isinstance(self.signals, GpuSignals):
                self.signals.attach_inbox(world.memory.allocate("sdma.inbox", inbox_bytes(size)))
        #: the peers in pull order: from the next rank on, so the W ranks do not all pull
        #: from rank 0 first
        self.peers = [(world.rank + k) % size for k in range(1, size)]
        #: pub, red, the stages and receive slots, and the routes of copies between them
        self.buffers = TransportBuffers(world, self.engine, self.peers,
                                        reduced=reduced and size > 1, stage_reduced=stage_reduced)
        self._pending: list[tuple[int, int, int]] = []  # (epoch, lo, hi) peers may still read
        #: call stream -> the newest epoch a fence there waited for (done is cumulative)
        self._fenced_on: dict[int, int] = {}
        #: bytes this rank pulled from peers' buffers, cumulative (tests compare wire_bytes)
        self.pulled_bytes = 0
        #: resyncs so far: a captured op call of before a resync is captured again, on
        #: every rank alike (ranks that failed a call may have seen different shapes)
        self.resyncs = 0
        #: a caller's CUDA graph holds the buffers (:meth:`capture_round`): they may not grow
        self.held = False
        #: events around each step of a call (GPU; :meth:`start_trace`)
        self.trace: StepTrace | None = None
        #: where a default-stream caller's calls run (:meth:`call_stream`)
        self.own_stream = OwnStream(world.device)
        #: the streams calls alternate on (:meth:`on_call_stream`); one (the caller's)
        #: off the GPU or without peers
        gpu = size > 1 and world.device.type == "cuda"
        self.call_streams = CallStreams(world.device, call_streams if gpu else 1,
                                        self.engine.stream if gpu else None)

    # ------------------------------------------------------------------ buffers

    def ensure_capacity(self, nbytes: int) -> None:
        """Collective. Grow every buffer to hold ``nbytes`` (grow-only, 1.5x at least);
        a growth that fails leaves no buffers and capacity 0. Refused in graph capture."""
        if nbytes <= self.capacity:
            return
        refuse_growth_in_capture(f"{self.owner} buffers ({nbytes} B per slice buffer)",
                                 self.world.device, self.held)
        self.quiesce()
        self.call_streams.handles()  # before any call can park a stream (the module doc)
        self.buffers.allocate(grown_size(nbytes, self.capacity, BUFFER_ALIGN))

    @property
    def capacity(self) -> int:
        """Bytes of one buffer (0: none yet)."""
        return self.buffers.capacity

    def check_fits(self, nbytes: int) -> int:
        """``nbytes``, or ``ValueError`` if a call of that many bytes exceeds the buffers."""
        if nbytes > self.capacity:
            raise ValueError(f"{self.owner}.all_reduce: a slice of {nbytes} B exceeds the "
                             f"capacity of {self.capacity} B: call ensure_capacity first")
        return nbytes

    def call_stream(self) -> contextlib.AbstractContextManager[int]:
        """The raw handle a call's steps are enqueued on: the caller's current stream, or
        for a caller on the default stream this rank's own (:class:`OwnStream
        <radiance_ar.transport.call_streams.OwnStream>`)."""
        return self.own_stream.entered()

    def on_call_stream(self, caller: int,
                       footprint: Footprint) -> contextlib.AbstractContextManager[int]:
        """The stream one call's steps go on, entered from the ``caller`` stream: the
        caller's itself, or one of two call streams (:mod:`radiance_ar.transport.call_streams`), ordered
        after the caller's work so far and, outside :meth:`overlapped`, before its later
        work. ``footprint``: what the call touches (calls that share bytes never overlap)."""
        return self.call_streams.call(caller, footprint)

    @contextlib.contextmanager
    def overlapped(self) -> Iterator[None]:
        """A block whose calls may overlap each other; the caller's stream waits for all
        of them (:meth:`radiance_ar.transport.call_streams.CallStreams.overlapped`) and for
        the decode lane at its end, also when it raises."""
        lane = self.decode_lane.block() if self.decode_lane is not None else contextlib.nullcontext()
        with self.call_streams.overlapped(), lane:
            yield

    @contextlib.contextmanager
    def decode_beside(self, stream: int) -> Iterator[int]:
        """Where the kernels enqueued inside run (yields the handle): inside an overlapped
        block with a decode lane, on the lane after ``stream``'s work so far
        (:mod:`radiance_ar.transport.side_lanes`), else on ``stream``. They may touch only
        bytes no later call of the block touches; the caller joins at the block's end."""
        if self.decode_lane is None or not self.decode_lane.active:
            yield stream
            return
        with self.decode_lane.current(self.engine.stream(stream)) as handle:
            yield handle

    def _caller_stream(self) -> torch.cuda.Stream:
        return self.engine.stream(current_stream_handle(self.world.device))

    def close(self) -> None:
        """Drop every buffer (capacity 0)."""
        self.buffers.close()

    # ------------------------------------------------------------------ steps

    def fence(self, lo: int, hi: int, stream: int) -> None:
        """Order ``stream`` after every peer read of ``pub`` bytes [lo, hi) still in flight."""
        if self.signals is None:
            return
        rnd = getattr(self.signals, "round", None)
        if rnd is not None:
            tokens.fence(self.signals, rnd, self.peers, lo, hi, stream)
            return
        hits = [ep for ep, a, b in self._pending if a < hi and lo < b]
        if len(self._pending) > MAX_PENDING:
            hits.append(self._pending[-1][0])
        if not hits:
            return
        epoch = max(hits)
        self.signals.wait_all(self.peers, "done", epoch, stream,
                              "the reuse fence (peer still reading)")
        if self.call_streams.is_call_stream(stream):  # it orders only its own later calls
            self._fenced_on[stream] = max(epoch, self._fenced_on.get(stream, 0))
            epoch = min(self._fenced_on.get(h, 0) for h in self.call_streams.handles())
        # every later write follows (the caller's stream, the publish lane, or every call
        # stream waited past them): those entries need no second wait
        self._pending = [x for x in self._pending if x[0] > epoch]

    def publish(self, t: int, slot: str, dst_off: int | None, src_addr: int, nbytes: int,
                stream: int, fence: tuple[int, int] | None = None) -> None:
        """Copy ``nbytes`` at ``src_addr`` (this rank's device memory: a stage, ``out``)
        into bytes [dst_off, dst_off + nbytes) of my ``slot``'s buffer (``pub`` for
        ``ready``, ``red`` for ``reduced``; ``dst_off`` None: already there) and post
        ``slot`` of call ``t``, after the reuse ``fence`` of those bytes: on the publish
        lane where there is one (:mod:`radiance_ar.transport.side_lanes`), else on ``stream``."""
        on = stream if self.lane is None else self.lane.start(
            0 if slot == "ready" else 1, self.engine.stream(stream))
        if fence is not None:
            self.fence(*fence, on)
        with traced(self.trace, on, "publish" if slot == "ready" else "publish reduced"):
            if dst_off is not None and nbytes:
                assert 0 <= dst_off and dst_off + nbytes <= self.capacity, (dst_off, nbytes)
                base, how = self.buffers.publish_routes["red" if slot == "reduced" else "pub"]
                copy_bytes(base + dst_off, src_addr, nbytes, on, how)
            self.signals.post(slot, t, on)

    def pull_from(self, slot: str, t: int, pulls: list[tuple[int, int, int, int]], stream: int,
                  what: str) -> None:
        """One pull phase: wait for ``slot`` of call ``t`` of every peer in ``pulls``, then
        for each ``(peer, dst_addr, src_off, nbytes)`` copy bytes [src_off, src_off +
        nbytes) of that peer's buffer (``pub`` for ``ready``, ``red`` for ``reduced``) to
        ``dst_addr`` (this rank's memory: a receive slot, ``out``, a stage). ``what`` names
        the call in errors. Every wait comes before the first copy: in a captured op call
        the W - 1 waits are then ONE batched stream memory operation, and each such
        operation is a graph node that costs the host about 1.9 us at every replay (H200,
        tools/results/2026-12-04-h200-replay-node-costs/), W - 1 of them per phase otherwise."""
        peers = [p for p, _, _, _ in pulls]
        with traced(self.trace, stream, "wait", slot, *peers):
            self.signals.wait_all(peers, slot, t, stream, what)
        buffer = "red" if slot == "reduced" else "pub"
        rnd = getattr(self.signals, "round", None)
        for peer, dst_addr, src_off, nbytes in pulls:
            assert 0 <= src_off and src_off + nbytes <= self.capacity, (src_off, nbytes)
            base, how = self.buffers.pull_routes[buffer, peer]
            with traced(self.trace, stream, "pull reduced" if slot == "reduced" else "pull", peer):
                if nbytes:
                    copy_bytes(dst_addr, base + src_off, nbytes, stream, how)
            if rnd is None:
                self.pulled_bytes += nbytes
            else:  # a capture: counted per replay (after_replay)
                rnd.pulled_bytes += nbytes

    def pull_all(self, t: int, off: int, nbytes: int, stream: int, what: str,
                 at: int | None = None) -> dict[int, torch.Tensor]:
        """Pull bytes [off, off + nbytes) of every peer's ``pub`` into its receive slot at
        byte ``at`` (default ``off``: the same bytes), after its ``ready`` of call ``t``,
        then post ``done``; returns peer -> those received bytes."""
        got = {p: self.buffers.recv_slot(p, nbytes, off if at is None else at)
               for p in self.peers}
        self.pull_from("ready", t, [(p, got[p].data_ptr(), off, nbytes) for p in self.peers],
                       stream, what)
        self.post_done(t, stream)
        return got

    def post_done(self, t: int, stream: int) -> None:
        """Post ``done`` of call ``t`` (every pull of it enqueued before), in call order."""
        self.call_streams.before_done(stream)
        self.signals.post("done", t, stream)

    def finish(self, t: int, off: int, nbytes: int, stream: int) -> None:
        """End call ``t``, whose ``pub`` bytes [off, off + nbytes) peers may still read:
        keep them for the fence, join the publish lane, mark the call's end."""
        rnd = getattr(self.signals, "round", None)
        if rnd is None:
            self._pending.append((t, off, off + nbytes))
        else:
            rnd.pending.append((rnd.k, off, off + nbytes))
        if self.lane is not None:
            self.lane.join(self.engine.stream(stream))
        self.signals.end_call(stream)

    # ------------------------------------------------------------------ captured op calls

    @contextlib.contextmanager
    def capture_round(self, end: Callable[[], None],
                      entry: CallSignature | None = None) -> Iterator[TokenRound]:
        """While a graph of op calls is captured on the current stream, ended by ``end()``
        (:func:`tokens.capture_round <radiance_ar.transport.tokens.capture_round>`); copies and
        stream operations take their graph forms (``Route.in_graph``, ``CopyEngine.in_graph``).
        ``entry``: the op call's signature in a caller's graph (:mod:`.caller_graphs`); once
        captured, the buffers are held (they may not grow)."""
        if not isinstance(self.signals, GpuSignals):
            raise TypeError(f"{self.owner}: only GPU worlds with peers capture op calls")
        # With peers parked here a capture that forked the decode lane blocked for good in
        # capture_end (H200, tests/test_graphs_gpu.py), as two call streams did.
        lane = (contextlib.nullcontext() if self.decode_lane is None
                else self.decode_lane.off_while(self.peers_parked_here))
        with lane, self.buffers.in_graph(), self.engine.in_graph() as node_params, \
                tokens.capture_round(self.signals, self.call_streams, self.peers,
                                     self.world.device, end, entry) as rnd:
            rnd.node_params = node_params
            yield rnd
        self.held = self.held or entry is not None

    def before_replay(self, stream: int) -> None:
        """Before a captured op call is launched on ``stream``: order it after every peer
        read of an eager call before it (a graph fences only its own calls)."""
        if self._pending:
            self.fence(0, self.capacity, stream)
            self._pending.clear()

    def after_replay(self, rnd: TokenRound, stream: int) -> None:
        """A graph captured in ``rnd`` was launched on ``stream``: count its bytes and
        give its waits to the host-side bound (:meth:`check`)."""
        self.pulled_bytes += rnd.pulled_bytes
        self.signals.replayed(rnd, stream)

    def quiesce(self) -> None:
        """Before buffers are replaced: every peer read done, every enqueued call finished
        (also the calls of an overlapped block not yet joined: a host wait for the last)."""
        if self.signals is None:
            return
        if self._pending:
            with self.call_stream() as stream:
                self.fence(0, self.capacity, stream)
        self.check()

    # ------------------------------------------------------------------ faults, timing

    def check(self, timeout_ms: float | None = None) -> None:
        """Host-side bounded wait for every call enqueued so far (GPU); raises naming a
        missing peer (:meth:`radiance_ar.transport.gpu_signals.GpuSignals.check`). CPU: waits are inline."""
        if self.signals is not None:
            self.signals.check(timeout_ms)

    def resync(self) -> None:
        """Collective (:meth:`radiance_ar.backends.interface.Backend.resync`). Emulated world: call
        :meth:`check` on EVERY rank first (it releases a stream blocked on a missing peer;
        the device sync here waits for every rank's streams). Refused in gpu-symm, on
        every rank: device-memory flags cannot be released, and the sync would wait
        forever for a missing peer."""
        if self.signals is None:
            return
        if self.world.kind == "gpu-symm":
            raise RuntimeError(
                f"{self.owner}.resync: not possible in a gpu-symm world: a stream waiting on a "
                "peer's device-memory flag cannot be released; if the peer never comes, "
                "restart the job (a late peer completes the call, leaving the ranks in step)")
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        self.signals.resync(self.world.memory.barrier)
        self._pending.clear()
        self._fenced_on.clear()
        self.resyncs += 1  # every peer read before the jump is over (no call in flight)

    def start_trace(self) -> StepTrace | None:
        """GPU: trace the steps of the calls that follow (None elsewhere)."""
        if self.world.device.type != "cuda" or self.world.size == 1:
            return None
        lanes = {current_stream_handle(self.world.device): "AR steps (caller stream)"}
        if self.own_stream.stream is not None:
            lanes[self.own_stream.stream.cuda_stream] = "AR steps (own stream: a default-stream caller)"
        lanes.update({h: f"AR steps (call stream {k})" for k, h in enumerate(self.call_streams.handles())})
        for lane, name in ((self.lane, "publish lane"), (self.decode_lane, "decode lane")):
            if lane is not None:
                lanes[lane.handle] = name
        self.trace = StepTrace(self.world.device, lanes)
        return self.trace

    @property
    def peers_parked_here(self) -> bool:
        """Emulated ranks with an active peer (not all passive, the timing mode of
        :func:`radiance_ar.transport.passive_peers.make_passive`): one host thread drives
        every rank, so a peer's stream may be parked on this rank's flags while this rank
        captures a graph, and such a capture can block for good (docs/design.md 3.6)."""
        return (self.world.kind == "gpu-emulated" and self.signals is not None
                and self.signals.passive_peers() != set(self.peers))

    def stop_trace(self) -> None:
        """End what :meth:`start_trace` began."""
        self.trace = None
