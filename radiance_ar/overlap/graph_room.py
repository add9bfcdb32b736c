"""Which captured op calls the op's graph cache keeps (:mod:`radiance_ar.overlap.graphs`).

A graph holds its layer's weight by address, so a model needs one graph per routed linear
and recurring M. The room keeps at most ``per_layer`` graphs per layer
(``RADIANCE_AR_OP_GRAPHS_PER_LAYER``) and ``limit`` in all, and decides, for a call whose
capture would drop a graph, whether it may:

- The victim: the layer's least called graph lately (of those, the least recently used)
  where the layer has its quota, else the least called of all where the room is full.
- Admission: the capture drops the victim only for a key called at least ``ADMIT_RATIO``
  times as often lately as the victim's; otherwise the call runs step by step. "Lately":
  every key's count of calls halves every ``USES_WINDOW_PER_GRAPH`` calls per graph held,
  or per graph of the layer quota where that is more (TinyLFU's sample), so a shape that stops coming yields its room. A shape that comes
  less often than about once a window is, to the room, a one-off.
- Too small: a refused key that recurs (``RECURRING_CALLS`` calls lately, and as often as
  the victim) while the victim is in use too (called since the key's previous call) is
  crowded out; a recurring key captured again after its graph was dropped is a recapture.
  Both are counted; the cache warns once. (A shape that stopped coming is not in use: a
  new one waiting for its count to fade is not crowded out.)

Why each rule (CPU models of the calls, tests/test_graph_room.py):

- Per layer, not per process: Llama-3.1-70B at TP 4 routes 160 linears; with a full chunk
  and a recurring remainder, the process-wide LRU of 256 graphs this replaced dropped every
  graph just before its next use, so every call captured (2880 captures in 3200 calls;
  docs/history.md, thirteenth session, has the model and its command).
- Admission: with 30% one-off M values among two recurring ones, a least-recently-used
  quota captured the one-offs that came back and dropped recurring graphs for them (1437
  captures in 4500 calls, 240 of them recurring graphs again; with the rule about 200, and
  none), while a capture costs the host a step-by-step call plus the instantiation.
- The ratio: equally recurring shapes over the quota, admitted on a count one higher (the
  halving rounds down), dropped each other at every round.
- The least called, not the least recently used: a graph called once a round shielded one
  called ten times, and a newcomer called nine times never got in.

Every decision depends only on the sequence of calls, so ranks that make the same calls
decide alike; :meth:`clear` (a new generation of buffers: after growth or a resync, on
every rank) starts every count over.
"""

from __future__ import annotations

import collections
from typing import Any, Hashable, Iterator


class GraphRoom:
    """The kept graphs (any values) by key, least recently used first, with their layers."""

    #: calls per graph held (at least a layer's quota) after which every count halves
    USES_WINDOW_PER_GRAPH = 10
    #: how many times as often lately a key must be called as the graph it would drop
    ADMIT_RATIO = 2
    #: calls lately from which a refused or recaptured key recurs (a key called twice may
    #: be a one-off M that came back once)
    RECURRING_CALLS = 5
    #: keys remembered as dropped (oldest forgotten first)
    DROPPED_KEYS = 4096

    def __init__(self, per_layer: int, limit: int):
        for name, value in (("per_layer", per_layer), ("limit", limit)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GraphRoom: {name} {value!r}: expected an int >= 1")
        self.per_layer, self.limit = per_layer, limit
        #: key -> (layer, value), least recently used first; and each layer's keys, alike
        self._kept: collections.OrderedDict[Hashable, tuple[Hashable, Any]] = \
            collections.OrderedDict()
        self._layers: dict[Hashable, collections.OrderedDict[Hashable, None]] = {}
        self._uses: collections.Counter[Hashable] = collections.Counter()
        self._calls = 0
        #: the number of each key's last call (of those counted), and the current key's
        #: previous one
        self._last: dict[Hashable, int] = {}
        self._serial = 0
        self._previous = -1
        self._dropped: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        #: refusals of a recurring key, and captures of a recurring key dropped before
        self.crowded_out = 0
        self.recaptures = 0

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: Hashable) -> Any:
        """``key``'s value, or None."""
        kept = self._kept.get(key)
        return None if kept is None else kept[1]

    def values(self) -> Iterator[Any]:
        return (value for _, value in self._kept.values())

    def called(self, key: Hashable) -> None:
        """One more call of ``key`` (its graph, if kept, becomes the most recently used)."""
        self._uses[key] += 1
        self._calls += 1
        self._serial += 1
        self._previous = self._last.get(key, -1)
        self._last[key] = self._serial
        if key in self._kept:
            self._kept.move_to_end(key)
            self._layers[self._kept[key][0]].move_to_end(key)
        if self._calls >= self.USES_WINDOW_PER_GRAPH * max(len(self._kept), self.per_layer):
            self._calls = 0
            self._uses = collections.Counter({k: n // 2 for k, n in self._uses.items() if n > 1})
            self._last = {k: n for k, n in self._last.items() if k in self._uses}

    def uses(self, key: Hashable) -> int:
        """``key``'s calls lately."""
        return self._uses[key]

    def victim(self, layer: Hashable) -> Hashable | None:
        """The key whose graph a capture for ``layer`` would drop (module doc); None where
        there is room."""
        mine = self._layers.get(layer, ())
        among = mine if len(mine) >= self.per_layer else \
            self._kept if len(self._kept) >= self.limit else None
        # min keeps the first of equals: iterated least recently used first
        return None if among is None else min(among, key=self._uses.__getitem__)

    def admits(self, key: Hashable, layer: Hashable) -> bool:
        """Whether ``key``'s capture may take room (module doc); a refusal of a recurring
        key beside a victim in use is counted in ``crowded_out``. Asked right after
        :meth:`called` of ``key``."""
        victim = self.victim(layer)
        if victim is None or self._uses[key] >= self.ADMIT_RATIO * self._uses[victim]:
            return True
        in_use = self._last.get(victim, -1) > self._previous
        if in_use and self._uses[key] >= max(self.RECURRING_CALLS, self._uses[victim]):
            self.crowded_out += 1
        return False

    def put(self, key: Hashable, layer: Hashable, value: Any) -> list[tuple[Hashable, Any]]:
        """Keep ``value`` for ``key`` of ``layer``, dropping the victim first if any (its
        key and value are returned, for the caller to release); a recurring key dropped
        before counts as a recapture."""
        victim = self.victim(layer)
        dropped = [] if victim is None else [(victim, self._drop(victim))]
        if key in self._dropped:
            del self._dropped[key]
            self.recaptures += self._uses[key] >= self.RECURRING_CALLS
        self._kept[key] = (layer, value)
        self._layers.setdefault(layer, collections.OrderedDict())[key] = None
        return dropped

    def forget_dropped(self, key: Hashable) -> None:
        """``key`` warms up again (its buffers moved): its next capture is a first one."""
        self._dropped.pop(key, None)

    def _drop(self, key: Hashable) -> Any:
        layer, value = self._kept.pop(key)
        del self._layers[layer][key]
        if not self._layers[layer]:
            del self._layers[layer]
        self._dropped[key] = None
        while len(self._dropped) > self.DROPPED_KEYS:
            self._dropped.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every graph, count and dropped key (a new generation of buffers)."""
        self._kept.clear()
        self._layers.clear()
        self._uses.clear()
        self._calls = 0
        self._last.clear()
        self._serial, self._previous = 0, -1
        self._dropped.clear()
