"""One launch per op call: the sliced path's device work captured once per shape, replayed.

Enqueued from Python, an op call of S slices costs the host every step of every slice
(GEMM launches, W-1 flag waits, copies, flag writes, codec or reduce launches): 1-3.4 ms
per call on an H200 host at S = 4-8, more than the device time of the call. Here the
first call of a shape runs step by step (it sizes every buffer and loads every kernel), the
second is captured into a CUDA graph and every later one replays it::

    host : copy x -> x_static | replay graph | copy out_static -> out      (3 launches)
    graph: prepare | GEMM slices (side) | ARs of the slices (caller, call streams, lane)
           | the done tokens of every peer, one batch | end event          (tokens.py)

What a replay must keep, and how:

- Flags: a graph's stream operations carry fixed values, so its calls use one-use
  tokens (:mod:`radiance_ar.transport.tokens`), not the eager calls' numbered tags.
  Each replay still takes a call number on the host and, where the flags are host
  memory, writes its header (the layer, M, K, N), where peers' messages and the abort
  word read it, and its waits are bounded by the backend's ``check`` like an eager call's.
- Addresses: x and out are bound by copies into persistent buffers (``x_static``,
  ``out_static``): one per role, column count and dtype, of the largest M captured, whose
  first M rows (a contiguous view) every graph of M rows binds, in every layer. Replays of
  one runtime run one after another on the caller's stream, each copy out enqueued before
  the next copy in, so they can share. A larger M grows the buffer and drops the graphs
  bound to the old one (captured again at their next call). A buffer per shape held, at
  Llama-3.1-70B TP 4, 272 MiB per recurring M of 8192 rows (the two linears' inputs,
  32 and 112 MiB, and their common output, 128 MiB); shared, the largest M's alone. The
  weight is the caller's tensor, which the key holds by address (a layer's weight does
  not move). A buffer that grows (the backend's, the scratch pool's) moves:
  every graph is then dropped (its generation is stale) and captured again.
- Memory: graphs share one private pool. A graph holds its layer's weight, so a model
  needs one per routed linear and recurring M: the cache keeps
  ``RADIANCE_AR_OP_GRAPHS_PER_LAYER`` graphs per layer and ``envs.MAX_OP_GRAPHS`` in all
  (per runtime: one per process, and under backend ``auto`` one per configuration
  chosen); :meth:`memory` reports what it holds. A process-wide count thrashed:
  Llama-3.1-70B routes 160 linears, and with two M values recurring (a full chunk and a
  remainder) an LRU of 256 graphs dropped every graph before its next use, so every call
  captured (the CPU model of tests/test_graph_cache.py: 2880 captures in 3200 calls).
- Admission: where a capture would drop a graph (the layer's least recently used, or the
  cache's where it is full), it does so only for a key called more often lately
  (counts halved every 10 calls per graph held); otherwise the call runs step by step. A
  one-off M that comes back would otherwise take a recurring M's room, to be captured
  again at its next call: with 30% one-off M values among two recurring ones (the CPU
  model of the tests), a plain LRU made 1437 captures in 4500 calls, 246 of them the
  recurring graphs again; with the rule, 230 and none of those (one-off M values that come
  back take each other's room). Counts fade so that a shape that stops coming yields its
  room: a sweep of 8 M values, 23 calls each, through one layer captures each within 3
  calls (tests/test_graph_cache.py). A key refused though it recurs as
  often as the graph it would drop (``crowded_out``), or a graph dropped and captured
  again (``recaptures``), says the cache is too small: both are counted and warned about
  once per runtime.

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
from radiance_ar.streams import current_stream_handle
from radiance_ar.transport.copy_engine import dedicated_stream
from radiance_ar.transport.tokens import TokenRound


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    round: TokenRound
    x: torch.Tensor  # the persistent input the graph reads
    out: torch.Tensor  # the persistent output the graph writes
    generation: Hashable
    layer: Hashable  # the layer it belongs to (its quota: GraphCache.per_layer)


class GraphCache:
    """Captured op calls of one runtime, by key (see the module doc)."""

    #: keys remembered as warmed up (oldest forgotten first: a forgotten key runs eagerly
    #: once more, on every rank alike), and keys remembered as dropped for room; the op's
    #: memo of sliced calls has the same bound (OverlapRuntime.remember_sliced_call)
    SEEN_KEYS = 4096
    #: op calls, per graph held (at least a layer's quota), after which every key's count
    #: of calls halves: "lately" is about 10 calls of each graph held (TinyLFU's sample;
    #: Llama-3.1-70B with 2 M values: 3200 calls, 10 forward passes), so a shape that stops
    #: coming yields its room to a new one within a few such windows
    USES_WINDOW_PER_GRAPH = 10
    #: calls lately from which a key that is refused room says so: a key called twice
    #: may be a one-off M that came back once
    RECURRING_CALLS = 3

    def __init__(self, device: torch.device, per_layer: int,
                 capture: Callable[[Any, Callable[[], None]], tuple[Any, TokenRound]] | None = None,
                 limit: int = MAX_OP_GRAPHS):
        """``per_layer``: graphs kept per layer, ``limit``: in all. ``capture(backend, run)``:
        capture ``run()`` into a graph, returning the graph (anything with ``replay()``) and
        the backend's token round; default: a CUDA graph on a stream of the cache's own
        (:meth:`capture_cuda_graph`)."""
        for name, value in (("per_layer", per_layer), ("limit", limit)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GraphCache: {name} {value!r}: expected an int >= 1")
        self.device, self.per_layer, self.limit = device, per_layer, limit
        self._capture_graph = capture if capture is not None else self.capture_cuda_graph
        self._entries: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        #: key -> the generation its eager warm-up call ran in (captured at the next call)
        self._seen: dict[Hashable, Hashable] = {}
        #: keys whose graph was dropped for room (a capture of one is a recapture)
        self._dropped: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        #: calls per key lately (halved as _count says): which graph is worth its room
        self._uses: collections.Counter[Hashable] = collections.Counter()
        self._calls = 0
        #: persistent x / out by (role, columns, dtype), rows: the largest M captured
        self._static: dict[tuple, torch.Tensor] = {}
        self._pool: Any = None
        #: captures run here, never on the caller's stream, which may be the default one
        #: (CUDA captures no legacy default stream); replays go on the caller's
        self._capture_stream: torch.cuda.Stream | None = None
        #: captures made, replays launched, and captures of a graph dropped for room before
        #: (reports; tests check the cache is used and does not thrash)
        self.captures = 0
        self.replays = 0
        self.recaptures = 0
        #: captures refused to a key called as often as the graph it would drop
        self.crowded_out = 0
        self._warned: set[str] = set()
        self._ahead = False  # inside capturing_ahead()

    def __len__(self) -> int:
        return len(self._entries)

    def memory(self) -> dict[str, int]:
        """What the cache holds: how many graphs, and the bytes of the persistent inputs
        and outputs (the graphs' own buffers live in the private pool, not counted here)."""
        return {"graphs": len(self._entries),
                "static_bytes": sum(t.numel() * t.element_size() for t in self._static.values())}

    @contextlib.contextmanager
    def capturing_ahead(self) -> Iterator[None]:
        """ONE op call inside (``overlap.forward`` on this cache's runtime, not the torch
        op, whose schema returns a tensor) captures its graph and replays nothing: it
        returns None, and the next call of that key replays (the capture takes no call
        number and waits for no peer). The call must be due for capture (its key warmed
        up eagerly, not yet captured), else ``ValueError``; a block that captured nothing
        (a call below min_m, inside a caller's graph, or on another runtime's cache, as an
        auto runtime's child) raises ``ValueError`` at its end. For a driver of emulated
        ranks with active peers (module doc): there every rank captures before any rank's
        replay can park."""
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
        ``key`` is seen, captured the second, replayed after; ``layer`` names the layer
        whose quota of graphs it counts in (its weight). ``generation()`` names the
        buffers a graph bakes in (it is asked after the body ran, when they have grown);
        ``sig`` is the op call's signature (its header per replay). Inside
        :meth:`capturing_ahead`: captured only, returning None."""
        now = generation()
        entry = self._entries.get(key)
        if entry is not None and entry.generation != now:
            self.clear()
            entry = None
        self._count(key)
        if self._ahead:
            if entry is not None or self._seen.get(key) != now:
                raise ValueError(
                    f"GraphCache.capturing_ahead: the call of {key!r} is not due for capture "
                    f"({'captured already' if entry is not None else 'not run eagerly first'}); "
                    "capture ahead only the call that follows a shape's eager one")
            self._capture(key, layer, x, out_shape, sig, backend, body, generation)
            return None
        due = self._seen.get(key) == now  # warmed up eagerly in these buffers
        if entry is None and (not due or not self._admits(key, layer, sig)):
            out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
            body(x, out)
            self._seen.pop(key, None)
            self._seen[key] = generation()
            if not due:  # warmed up again (its buffers moved): its capture is a first one
                self._dropped.pop(key, None)
            _forget_oldest(self._seen)
            return out
        if entry is None:
            entry = self._capture(key, layer, x, out_shape, sig, backend, body, generation)
        self._entries.move_to_end(key)
        entry.x.copy_(x)
        stream = current_stream_handle(self.device)
        with backend.replay_call(sig, entry.round, stream):
            entry.graph.replay()
        self.replays += 1
        # one call: torch.empty and copy_ took the host 6.6 + 10.1 us, clone 8 (H200 host,
        # tools/results/2026-12-04-h200-replay-node-costs/host_pieces.json, host_ab.json)
        return entry.out.clone()

    def clear(self) -> None:
        """Drop every graph (their buffers moved, or the runtime closes)."""
        self._entries.clear()
        self._seen.clear()
        self._dropped.clear()
        self._uses.clear()
        self._static.clear()

    def _count(self, key: Hashable) -> None:
        """One more call of ``key``; every USES_WINDOW_PER_GRAPH calls per graph held all
        counts halve (old calls fade, and keys called once in a while leave the counter)."""
        self._uses[key] += 1
        self._calls += 1
        if self._calls >= self.USES_WINDOW_PER_GRAPH * max(len(self._entries), self.per_layer):
            self._calls = 0
            self._uses = collections.Counter({k: n // 2 for k, n in self._uses.items() if n > 1})

    def _victim(self, layer: Hashable) -> Hashable | None:
        """The graph a capture for ``layer`` would drop: the layer's least recently used
        where it has its quota, else the least recently used of all where the cache is
        full; None where there is room."""
        mine = [k for k, e in self._entries.items() if e.layer == layer]
        if len(mine) >= self.per_layer:
            return mine[0]
        return next(iter(self._entries)) if len(self._entries) >= self.limit else None

    def _admits(self, key: Hashable, layer: Hashable, sig: CallSignature) -> bool:
        """Whether ``key``'s capture may take room: where it would drop a graph, only if
        ``key`` was called more often lately than that graph's key. A one-off M that comes
        back runs step by step instead of dropping a recurring M's graph (which would be
        captured again at its next call). One that recurs (``RECURRING_CALLS`` calls lately)
        as often as the graph it would drop is counted as crowded out (``crowded_out``) and
        warned about once."""
        victim = self._victim(layer)
        if victim is None or self._uses[key] > self._uses[victim]:
            return True
        if self._uses[key] == self._uses[victim] >= self.RECURRING_CALLS:
            self.crowded_out += 1
            self._warn_once("crowded_out", "calls of layer %d with %d rows recur as often as "
                            "the graphs the cache keeps and run step by step", sig)
        return False

    def _warn_once(self, kind: str, what: str, sig: CallSignature) -> None:
        """One warning per cache and ``kind`` (the counter's name): more shapes recur than
        it keeps."""
        if kind not in self._warned:
            self._warned.add(kind)
            logging.getLogger("radiance_ar").warning(
                "radiance-ar op graphs: " + what + ": more shapes recur than the cache keeps "
                "(%d per layer, RADIANCE_AR_OP_GRAPHS_PER_LAYER; %d in all); said once per "
                "runtime, counted in GraphCache.%s", sig.layer, sig.rows, self.per_layer,
                self.limit, kind)

    def _make_room(self, layer: Hashable) -> None:
        """Before a capture for ``layer``: drop :meth:`_victim`, if any."""
        victim = self._victim(layer)
        if victim is not None:
            self._drop(victim)

    def _drop(self, key: Hashable) -> None:
        """Drop ``key``'s graph for room, and the persistent buffers no graph left binds."""
        del self._entries[key]
        self._dropped[key] = None
        _forget_oldest(self._dropped)
        used = {k for e in self._entries.values() for k in _static_key(e)}
        for k in [k for k in self._static if k not in used]:
            del self._static[k]

    def _static_rows(self, role: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``rows`` rows of the persistent ``role`` buffer of ``cols`` columns,
        grown where it has fewer: the graphs bound to the old one are dropped then (not for
        room: they are captured again at their next call, uncounted)."""
        k = (role, cols, dtype)
        buf = self._static.get(k)
        if buf is None or buf.shape[0] < rows:
            for key in [key for key, e in self._entries.items() if k in _static_key(e)]:
                del self._entries[key]
            self._static.pop(k, None)
            del buf  # the old buffer is freed before the new one is allocated
            buf = self._static[k] = torch.empty((rows, cols), dtype=dtype, device=self.device)
        return buf[:rows]

    def _capture(self, key: Hashable, layer: Hashable, x: torch.Tensor,
                 out_shape: tuple[int, int], sig: CallSignature, backend: Any, body: Callable,
                 generation: Callable[[], Hashable]) -> _Entry:
        self._make_room(layer)
        x_static = self._static_rows("x", x.shape[0], x.shape[1], x.dtype)
        out_static = self._static_rows("out", out_shape[0], out_shape[1], x.dtype)
        graph, rnd = self._capture_graph(backend, lambda: body(x_static, out_static))
        self.captures += 1
        if key in self._dropped:
            del self._dropped[key]
            self.recaptures += 1
            self._warn_once("recaptures", "a graph dropped for room was captured again (layer "
                            "%d, %d rows)", sig)
        entry = _Entry(graph, rnd, x_static, out_static, generation(), layer)
        self._entries[key] = entry
        return entry

    def capture_cuda_graph(self, backend: Any, run: Callable[[], None]) -> tuple[Any, TokenRound]:
        """``run()`` captured into a CUDA graph inside the backend's token round, on the
        cache's own stream, in the cache's private pool; no device synchronization."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._capture_stream = dedicated_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                # the round ends the capture itself: a capture_end that fails is then a
                # failed round, whose marks on this rank's header are undone
                with backend.capture_round(graph.capture_end) as rnd:
                    run()
            finally:
                if torch.cuda.is_current_stream_capturing():  # the round never began
                    graph.capture_end()
        return graph, rnd



def _static_key(entry: _Entry) -> tuple[tuple, tuple]:
    """The keys of the persistent buffers ``entry`` binds (``GraphCache._static``)."""
    return (("x", entry.x.shape[1], entry.x.dtype), ("out", entry.out.shape[1], entry.out.dtype))


def _forget_oldest(remembered: dict) -> None:
    """Bound a dict of remembered keys at :attr:`GraphCache.SEEN_KEYS`, oldest out first."""
    while len(remembered) > GraphCache.SEEN_KEYS:
        remembered.pop(next(iter(remembered)))
