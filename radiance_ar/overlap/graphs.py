"""One launch per op call: the sliced path's device work captured once per shape, replayed.

Enqueued from Python, an op call of S slices costs the host every step of every slice
(GEMM launches, W-1 flag waits, copies, flag writes, codec or reduce launches): 1-3.4 ms
per call on an H200 host at S = 4-8, more than the device time of the call. Here the
first call of a shape runs step by step (it sizes every buffer and loads every kernel), the
second is captured into a CUDA graph (where the room allows: :mod:`.graph_room`) and every
later one replays it::

    host : copy x -> x_static | replay graph | copy out_static -> out      (3 launches)
    graph: prepare | GEMM slices (side) | ARs of the slices (the capturing stream; the
           decode lane unless peers are parked here)
           | the done tokens of every peer, one batch | end event          (tokens.py)

What a replay must keep, and how:

- Flags: a graph's stream operations carry fixed values, so its calls use one-use
  tokens (:mod:`radiance_ar.transport.tokens`), not the eager calls' numbered tags.
  Each replay still takes a call number on the host and, where the flags are host
  memory, writes its header (the layer, M, K, N), where peers' messages and the abort
  word read it, and its waits are bounded by the backend's ``check`` like an eager call's.
- Addresses: x and out are bound by copies into persistent buffers (``x_static``,
  ``out_static``): one per role, column count, dtype and rows rounded up to a power of two,
  whose first M rows (a contiguous view) every graph of M rows in that range binds, in
  every layer. Replays of one runtime run one after another on the caller's stream, each
  copy out enqueued before the next copy in, so they can share. A buffer per shape held, at
  Llama-3.1-70B TP 4, 272 MiB per recurring M of 8192 rows (the two linears' inputs, 32
  and 112 MiB, and their common output, 128 MiB); by power of two, M values of one range
  share, and all ranges together stay under twice the largest (a single buffer grown to
  the largest M would drop every graph bound to it at each growth, for one-off M values
  too). The weight is the caller's tensor, which the key holds by address (a layer's
  weight does not move). A buffer that grows (the backend's, the scratch pool's) moves:
  every graph is then dropped (a new generation) and captured again.
- Memory: graphs share one private pool; graphs dropped with their generation are held
  until the next capture holds the pool too (torch refuses a capture into a pool no live
  graph holds, and frees such a pool's memory only at an ``empty_cache``). Which graphs
  are kept, and when a capture may drop one (the quota per layer, the admission by recent
  calls, the warnings when more shapes recur than fit): :mod:`radiance_ar.overlap.graph_room`.
  :meth:`GraphCache.memory` reports what the cache holds. A call whose capture the room
  refuses runs step by step.

What a replay costs the host (H200 host, CUDA 13.0, graphs of 8 and 128 nodes of one
kind; tools/results/2026-12-04-h200-replay-node-costs/): ``graph.replay()`` takes about
5 us, plus per node about nothing for kernels and device-to-device copies, 2.1 us for a
copy to or from pinned host memory and 1.6-1.9 us for a batched stream memory operation
(to device or host memory alike). Hence a pull phase's W - 1 waits are one batch
(:meth:`CopyTransport.pull_from <radiance_ar.transport.copy_transport.CopyTransport.pull_from>`),
and in the emulated world, whose cross-rank bytes all pass through host memory, a replay's
host time still grows with S (W = 4 two-shot: 8 host copies and 3 batches a slice).

No capture synchronizes the device (``torch.cuda.graph`` would): in a world of emulated
ranks a peer's stream may be parked on this rank's next call, and a device-wide
synchronize would wait for it forever. Yet a capture made while a peer's replay waits on
this rank blocked in ``capture_end`` there (docs/design.md 3.6): a driver of emulated
ranks with active peers captures every rank's graph of a call first
(:meth:`GraphCache.capturing_ahead`, :meth:`radiance_ar.harness.emulated.EmulatedRanks.capture_ahead`),
then replays.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch

from radiance_ar.call_contract import CallSignature
from radiance_ar.envs import MAX_OP_GRAPHS
from radiance_ar.overlap.graph_room import GraphRoom
from radiance_ar.transport.copy_engine import dedicated_stream
from radiance_ar.transport.tokens import TokenRound


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    round: TokenRound
    x: torch.Tensor  # the persistent input the graph reads
    out: torch.Tensor  # the persistent output the graph writes


class GraphCache:
    """Captured op calls of one runtime, by key (see the module doc)."""

    #: keys remembered as warmed up (oldest forgotten first: a forgotten key runs eagerly
    #: once more, on every rank alike); the op's memo of sliced calls has the same bound
    #: (OverlapRuntime.remember_sliced_call)
    SEEN_KEYS = 4096

    def __init__(self, device: torch.device, per_layer: int,
                 capture: Callable[[Any, Callable[[], None]], tuple[Any, TokenRound]] | None = None,
                 limit: int = MAX_OP_GRAPHS):
        """``per_layer``: graphs kept per layer, ``limit``: in all (:class:`GraphRoom`).
        ``capture(backend, run)``: capture ``run()`` into a graph, returning the graph
        (anything with ``replay()``) and the backend's token round; default: a CUDA graph
        on a stream of the cache's own (:meth:`capture_cuda_graph`)."""
        self.device = device
        #: the kept graphs (:class:`_Entry` values), the quota and the admission rule
        self.room = GraphRoom(per_layer, limit)
        self._capture_graph = capture if capture is not None else self.capture_cuda_graph
        #: the buffers every graph bakes in (``generation()`` of :meth:`call`): when they
        #: change, every graph and count starts over
        self._generation: Hashable = None
        #: keys warmed up in this generation and not kept (captured at a later call): run
        #: eagerly, or their graph dropped for room
        self._seen: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        #: persistent x / out by (role, columns, dtype, rows rounded up to a power of two)
        self._static: dict[tuple, torch.Tensor] = {}
        self._pool: Any = None
        #: the graphs of a past generation, held until a capture holds the private pool:
        #: torch refuses (an internal assert) a capture into a pool that no live graph
        #: holds any more (CUDACachingAllocator's create_or_incref_pool), and freeing them
        #: first would leave their pool's memory to be freed only by an empty_cache
        self._retired: list[Any] = []
        #: captures run here, never on the caller's stream, which may be the default one
        #: (CUDA captures no legacy default stream), and the persistent buffers are
        #: allocated here (:meth:`_static_rows`); replays go on the caller's
        self._capture_stream: torch.cuda.Stream | None = None
        #: captures made and replays launched (reports; tests check the cache is used)
        self.captures = 0
        self.replays = 0
        self._warned: set[str] = set()
        self._ahead = False  # inside capturing_ahead()

    def __len__(self) -> int:
        return len(self.room)

    def memory(self) -> dict[str, int]:
        """What the cache holds: how many graphs, and the bytes of the persistent inputs
        and outputs (the graphs' own buffers live in the private pool, not counted here)."""
        return {"graphs": len(self.room),
                "static_bytes": sum(t.numel() * t.element_size() for t in self._static.values())}

    @contextlib.contextmanager
    def capturing_ahead(self) -> Iterator[None]:
        """ONE op call inside (``overlap.forward`` on this cache's runtime, not the torch
        op, whose schema returns a tensor) captures its graph and replays nothing: it
        returns None, and the next call of that key replays (the capture takes no call
        number and waits for no peer). The call must be due for capture (its key warmed
        up eagerly, not yet captured), else ``ValueError``; the room's admission does not
        apply (its victim, if any, is dropped). A block that captured nothing (a call
        below min_m, inside a caller's graph, or on another runtime's cache, as an auto
        runtime's child) raises ``ValueError`` at its end. For a driver of emulated ranks
        with active peers (module doc): there every rank captures before any rank's replay
        can park."""
        if self._ahead:
            raise ValueError("GraphCache.capturing_ahead: already capturing ahead")
        self._ahead, before = True, self.captures
        try:
            yield
        finally:
            self._ahead = False
        if self.captures != before + 1:
            raise ValueError(f"GraphCache.capturing_ahead: {self.captures - before} captures in "
                             "the block, expected 1 (one sliced op call due for capture on "
                             "this cache's runtime)")

    def call(self, key: Hashable, layer: Hashable, generation: Callable[[], Hashable],
             x: torch.Tensor, out_shape: tuple[int, int], sig: CallSignature, backend: Any,
             body: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor | None:
        """``body(x, out)`` (the op's sliced path) for ``x``: eagerly the first time its
        ``key`` is seen, captured at a later call where the room admits it (the second,
        unless it would drop a graph called more than half as often lately), replayed
        after; ``layer`` names the layer whose quota it counts in (its weight).
        ``generation()`` names the buffers a graph bakes in (also asked after an eager
        body, which may grow them);
        ``sig`` is the op call's signature (its header per replay). Inside
        :meth:`capturing_ahead`: captured only, returning None."""
        self._renew(generation())
        entry = self.room.get(key)
        due = entry is None and key in self._seen  # warmed up eagerly in these buffers
        if self._ahead and not due:  # refused before anything is counted
            raise ValueError(
                f"GraphCache.capturing_ahead: the call of {key!r} is not due for capture "
                f"({'captured already' if entry is not None else 'not run eagerly first'}); "
                "capture ahead only the call that follows a shape's eager one")
        self.room.called(key)
        if self._ahead:
            self._capture(key, layer, x, out_shape, sig, backend, body)
            return None
        if entry is None and not (due and self._admitted(key, layer, sig)):
            out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
            body(x, out)
            if self._renew(generation()) or not due:  # warmed up: a first capture next
                self.room.forget_dropped(key)
            self._remember(key)
            return out
        if entry is None:
            entry = self._capture(key, layer, x, out_shape, sig, backend, body)
        entry.x.copy_(x)
        with backend.replay_call(sig, entry.round):  # on the stream it makes current
            entry.graph.replay()
        self.replays += 1
        # one call: torch.empty and copy_ took the host 6.6 + 10.1 us, clone 8 (H200 host,
        # tools/results/2026-12-04-h200-replay-node-costs/host_pieces.json; its host_ab.json,
        # trimmed: git show 6a42d9c^:tools/results/2026-12-04-h200-replay-node-costs/host_ab.json)
        return entry.out.clone()

    def clear(self) -> None:
        """Drop every graph and forget every key (the runtime closes)."""
        self._forget_all()
        self._retired.clear()

    def _forget_all(self) -> None:
        self.room.clear()
        self._seen.clear()
        self._static.clear()

    def _renew(self, now: Hashable) -> bool:
        """Where the buffers' generation is not ``now`` any more: every graph dropped
        (retired until the next capture) and every key forgotten, on every rank alike
        (growth and resync are collective); whether it did."""
        if now == self._generation:
            return False
        self._retired.extend(e.graph for e in self.room.values())
        self._forget_all()
        self._generation = now
        return True

    def _remember(self, key: Hashable) -> None:
        """``key`` is warm in this generation and not kept (most recent; oldest forgotten)."""
        self._seen.pop(key, None)
        self._seen[key] = None
        while len(self._seen) > self.SEEN_KEYS:
            self._seen.popitem(last=False)

    def _admitted(self, key: Hashable, layer: Hashable, sig: CallSignature) -> bool:
        """The room's admission of ``key``'s capture; a crowded-out key warned about once."""
        crowded = self.room.crowded_out
        if self.room.admits(key, layer):
            return True
        if self.room.crowded_out > crowded:
            self._warn_once("crowded_out", "calls of layer %d with %d rows recur as often as "
                            "the graph they would drop and run step by step", sig)
        return False

    def _warn_once(self, kind: str, what: str, sig: CallSignature) -> None:
        """One warning per cache and ``kind`` (the room's counter): more shapes recur than
        the cache keeps."""
        if kind not in self._warned:
            self._warned.add(kind)
            logging.getLogger("radiance_ar").warning(
                "radiance-ar op graphs: " + what + ": more shapes recur than the cache keeps "
                "(%d per layer, RADIANCE_AR_OP_GRAPHS_PER_LAYER; %d in all); said once per "
                "runtime, counted in GraphCache.room.%s", sig.layer, sig.rows,
                self.room.per_layer, self.room.limit, kind)

    def _static_rows(self, role: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``rows`` rows of the persistent ``role`` buffer of ``cols`` columns
        for rows up to the next power of two."""
        k = (role, cols, dtype, _rows_bound(rows))
        buf = self._static.get(k)
        if buf is None:
            # On the cache's own stream: freed once no graph binds it, its bytes go back to
            # that stream's blocks, which only a later buffer of this cache takes (its first
            # use ordered after every earlier call: OverlapRuntime._after_last_stream), never
            # to other work of a caller's stream that a call on another stream ran beside.
            own = (torch.cuda.stream(self._own_stream()) if self.device.type == "cuda"
                   else contextlib.nullcontext())
            with own:
                buf = self._static[k] = torch.empty((k[3], cols), dtype=dtype,
                                                    device=self.device)
        return buf[:rows]

    def _own_stream(self) -> torch.cuda.Stream:
        # Made at the first capture, inside an op call: a stream made while an emulated peer
        # is parked can block (ScratchPool.open), but a capture never meets one (emulated
        # ranks capture ahead, or time against passive peers; module doc).
        if self._capture_stream is None:
            self._capture_stream = dedicated_stream(self.device)
        return self._capture_stream

    def _capture(self, key: Hashable, layer: Hashable, x: torch.Tensor,
                 out_shape: tuple[int, int], sig: CallSignature, backend: Any,
                 body: Callable) -> _Entry:
        x_static = self._static_rows("x", x.shape[0], x.shape[1], x.dtype)
        out_static = self._static_rows("out", out_shape[0], out_shape[1], x.dtype)
        graph, rnd = self._capture_graph(backend, lambda: body(x_static, out_static))
        self.captures += 1
        entry = _Entry(graph, rnd, x_static, out_static)
        recaptures = self.room.recaptures
        self._seen.pop(key, None)
        dropped = self.room.put(key, layer, entry)
        for old, _ in dropped:  # still warm: due for capture again at its next call
            self._remember(old)
        if dropped:  # and the persistent buffers no graph binds any more go
            used = {k for e in self.room.values() for k in _static_keys(e)}
            for k in [k for k in self._static if k not in used]:
                del self._static[k]
        if self.room.recaptures > recaptures:
            self._warn_once("recaptures", "a graph dropped for room was captured again (layer "
                            "%d, %d rows)", sig)
        return entry

    def capture_cuda_graph(self, backend: Any, run: Callable[[], None]) -> tuple[Any, TokenRound]:
        """``run()`` captured into a CUDA graph inside the backend's token round, on the
        cache's own stream, in the cache's private pool; no device synchronization."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._own_stream()):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                # the round ends the capture itself: a capture_end that fails is then a
                # failed round, whose marks on this rank's header are undone
                with backend.capture_round(graph.capture_end) as rnd:
                    run()
            finally:
                if torch.cuda.is_current_stream_capturing():  # the round never began
                    graph.capture_end()
        self._retired.clear()  # the new graph holds the pool now
        return graph, rnd


def _rows_bound(rows: int) -> int:
    """``rows`` rounded up to a power of two: the rows of the persistent buffer it binds."""
    return 1 << max(rows - 1, 0).bit_length()


def _static_keys(entry: _Entry) -> tuple[tuple, tuple]:
    """The keys of the persistent buffers ``entry`` binds (``GraphCache._static``)."""
    return tuple((role, t.shape[1], t.dtype, _rows_bound(t.shape[0]))
                 for role, t in (("x", entry.x), ("out", entry.out)))
