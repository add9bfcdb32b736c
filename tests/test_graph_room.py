"""Which captured op calls the graph cache keeps (radiance_ar.overlap.graph_room), on the
CPU: the room alone, then models of a model's calls through the cache (stand-in graphs that
re-run the body on the persistent buffers, as tests/test_graph_cache.py)."""

import contextlib
import logging
import random

import pytest
import torch

from radiance_ar import envs
from radiance_ar.call_contract import CallSignature
from radiance_ar.overlap.graph_room import GraphRoom
from radiance_ar.overlap.graphs import GraphCache


class Replayable:
    def __init__(self, run):
        self.replay = run


class Backend:
    @contextlib.contextmanager
    def replay_call(self, sig, rnd):
        yield


def drive(calls, per_layer=None, limit=envs.MAX_OP_GRAPHS, cache=None, generation=0):
    """Op calls of (M, layer) through a cache (default quota), in buffers of ``generation``;
    each result checked. Returns the cache and what each call did: 'eager', 'captured' or
    'replayed'."""
    if per_layer is None:
        per_layer = envs.KNOBS["RADIANCE_AR_OP_GRAPHS_PER_LAYER"].default
    if cache is None:  # (not ``or``: an empty cache has no length)
        cache = GraphCache(torch.device("cpu"), per_layer,
                           lambda backend, run: (Replayable(run), None), limit)
    did = []
    for m, layer in calls:
        x = torch.full((m, 2), float(len(did)))
        captures, replays = cache.captures, cache.replays
        out = cache.call((m, layer), layer, lambda: generation, x, (m, 2),
                         CallSignature(m, 2, x.dtype, layer=layer), Backend(),
                         lambda x_in, out: torch.mul(x_in, 3.0, out=out))
        assert torch.equal(out, x * 3.0), (m, layer, len(did))
        did.append("captured" if cache.captures > captures else
                   "replayed" if cache.replays > replays else "eager")
    return cache, did


# ---------------------------------------------------------------- the room alone

def test_the_victim_is_the_least_called_lately_of_the_layer_then_of_the_room():
    room = GraphRoom(per_layer=2, limit=3)
    for key, layer, calls in (("a", 1, 3), ("b", 1, 1), ("c", 2, 2)):
        for _ in range(calls):
            room.called(key)
        assert room.victim(layer) is None
        assert room.put(key, layer, key.upper()) == []
    room.called("b")  # b is layer 1's most recently used, and still its least called
    assert room.victim(1) == "b"  # layer 1 has its quota
    assert room.victim(3) == "c"  # the room is full: of a (3), b (2), c (2) the older of c, b
    room.called("d")
    assert room.put("d", 1, "D") == [("b", "B")] and list(room._kept) == ["a", "c", "d"]


def test_counts_halve_every_window_and_keys_called_once_leave():
    room = GraphRoom(per_layer=2, limit=8)  # no graph held: a window of 10 x 2 calls
    for key in "a" * 12 + "b" * 7:
        room.called(key)
    assert (room.uses("a"), room.uses("b")) == (12, 7)
    room.called("c")  # the twentieth call: every count halves, c's 1 leaves
    assert (room.uses("a"), room.uses("b"), room.uses("c")) == (6, 3, 0)


def test_a_capture_that_would_drop_a_graph_needs_twice_its_calls():
    room = GraphRoom(per_layer=1, limit=8)
    for _ in range(3):
        room.called("hot")
    room.put("hot", 1, "H")
    for n in range(1, 7):
        room.called("new")
        assert room.admits("new", 1) == (n >= 6), n
    assert room.crowded_out == 0  # "hot" was not called since: it is not in use


@pytest.mark.parametrize("per_layer, limit, named", [(0, 4, "per_layer 0"), (4, 0, "limit 0"),
                                                     (2.0, 4, "per_layer 2.0")])
def test_quota_and_limit_are_checked(per_layer, limit, named):
    with pytest.raises(ValueError, match=named):
        GraphRoom(per_layer, limit)


# ---------------------------------------------------------------- models of a model's calls

def test_a_70b_model_with_two_recurring_m_values_captures_each_once_then_replays():
    # Llama-3.1-70B at TP 4 routes 160 linears (80 layers: o_proj, down_proj); a chunked
    # prefill alternates a full chunk with a remainder that comes back. A process-wide LRU
    # of 256 graphs dropped each graph before its next use (2880 captures in these 3200
    # calls); the quota per layer keeps all 320, whichever M comes first.
    for order in ((12, 8), (8, 12)):
        calls = [(m, layer) for _ in range(10) for m in order for layer in range(1, 161)]
        cache, did = drive(calls)
        assert (did[:320].count("eager"), did[320:640].count("captured")) == (320, 320)
        assert did[640:] == ["replayed"] * 2560, order
        assert cache.memory()["static_bytes"] == 2 * (16 + 8) * 2 * 4


def test_one_off_m_values_that_come_back_never_take_a_recurring_ms_room(caplog):
    # a chunked prefill under light load: two recurring M values and, 30% of the time, an M
    # of 16-80 rows. A plain LRU captured 1437 times in these 4500 calls, 240 of them the
    # recurring graphs captured again; the room admits a capture that would drop a graph
    # only for a key called twice as often lately.
    rng, hot, layers = random.Random(0), (64, 48), 3
    steps = [hot[s % 2] if rng.random() < 0.7 else rng.randint(16, 80) for s in range(1500)]
    calls = [(m, layer) for m in steps for layer in range(1, layers + 1)]
    with caplog.at_level(logging.WARNING, logger="radiance_ar"):
        cache, did = drive(calls)
    recurring = [d for (m, _), d in zip(calls, did) if m in hot]
    assert recurring.count("captured") == len(hot) * layers  # never dropped, never again
    assert recurring[len(hot) * layers * 2:].count("eager") == 0
    assert cache.captures < 250 and len(cache) <= 4 * layers
    assert cache.memory()["static_bytes"] <= 2 * 2 * 128 * 2 * 4  # ranges up to 128 rows
    # one-off M values are not "more shapes recur than fit": no warning
    assert (cache.room.crowded_out, cache.room.recaptures, caplog.records) == (0, 0, [])


def test_equally_recurring_shapes_over_the_quota_run_step_by_step_without_thrashing(caplog):
    # six M values in turn through 40 layers, four graphs a layer: an admission on a count
    # one higher (the halving rounds down) dropped and captured graphs at every round
    calls = [(m, layer) for _ in range(30) for m in range(10, 16) for layer in range(1, 41)]
    with caplog.at_level(logging.WARNING, logger="radiance_ar"):
        cache, did = drive(calls)
    assert (cache.captures, cache.room.recaptures) == (4 * 40, 0)
    assert did[-240:].count("replayed") == 4 * 40  # each layer: four replay, two step by step
    assert cache.room.crowded_out > 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "recur as often as the graph they would drop" in warned[0]
    assert "RADIANCE_AR_OP_GRAPHS_PER_LAYER" in warned[0]


def test_a_sweep_of_m_values_through_one_layer_captures_each_within_a_few_calls(caplog):
    # a benchmark running 23 calls of each of 8 M values, largest first, through one layer
    # with room for 4: a shape that stops coming yields its room as its count fades (the
    # fifth to eighth M run 7-9 calls step by step: the old count must halve once)
    calls = [(m, 1) for m in range(15, 7, -1) for _ in range(23)]
    with caplog.at_level(logging.WARNING, logger="radiance_ar"):
        cache, did = drive(calls)
    for n in range(8):
        mine = did[23 * n:23 * (n + 1)]
        assert mine.count("captured") == 1 and mine.index("captured") <= (1 if n < 4 else 10), \
            (n, mine)
    assert caplog.records == []  # old shapes not in use: nothing is crowded out


def test_ranks_that_made_different_calls_before_a_new_generation_decide_alike_after_it():
    # a rank that made one call more before an error and its resync (a new generation of
    # buffers on every rank) must make the same eager / capture / replay decisions after it
    caches = []
    for extra in (0, 1):
        cache = GraphCache(torch.device("cpu"), 2, lambda backend, run: (Replayable(run), None))
        before = [(m, 1) for m in (8, 4, 2) * 10] + [(8, 1)] * extra
        drive(before, cache=cache)
        caches.append(cache)
    rng = random.Random(1)
    after = [(rng.choice((8, 4, 2, 16)), 1) for _ in range(300)]
    did = [drive(after, cache=cache, generation=1)[1] for cache in caches]
    assert did[0] == did[1] and did[0][0] == "eager"  # every shape warms up again


def test_a_graph_called_once_a_round_does_not_shield_a_busier_key():
    # rounds of B x 10, A x 1 (both kept, two a layer), then C x 9 joins: the victim is the
    # least called lately (A), not the least recently used (B), so C takes A's room
    calls = [("B", 10), ("A", 1)] * 4 + [("C", 9), ("B", 10), ("A", 1)] * 6
    cache, did = drive([(m, 1) for name, n in calls for m in [ord(name)] * n], per_layer=2)
    mine = [d for (name, n) in calls for d in [name] * n]
    c_calls = [d for name, d in zip(mine, did) if name == "C"]
    assert c_calls.count("captured") == 1 and c_calls[-9:] == ["replayed"] * 9


def test_a_refused_capture_ahead_counts_nothing_so_ranks_stay_alike():
    # EmulatedRanks.capture_ahead stops at the first rank whose block raises: that rank's
    # room must not have counted the call the others never made
    cache, did = drive([(8, 1)] * 3)
    uses = cache.room.uses((8, 1))
    with pytest.raises(ValueError, match="captured already"), cache.capturing_ahead():
        drive([(8, 1)], cache=cache)
    assert cache.room.uses((8, 1)) == uses


def test_a_recurring_graph_dropped_for_room_is_due_again_and_its_capture_is_counted(caplog):
    # one graph a layer; M = 2 recurring, then M = 3 comes four times as often: it takes the
    # room; M = 2 back, as often, takes it back, a recapture of a recurring key, warned once
    calls = [(2, 1)] * 6 + [(3, 1)] * 30 + [(2, 1)] * 40
    with caplog.at_level(logging.WARNING, logger="radiance_ar"):
        cache, did = drive(calls, per_layer=1)
    assert did.count("captured") == 3 and cache.room.recaptures == 1
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == [
        "a graph dropped for room was captured again (layer 1, 2 rows)"]


def test_the_gpu_tests_sequence_captures_only_ahead():
    # tests/test_graphs_gpu.py drives emulated ranks with active peers, where a capture
    # while a peer's replay waits can block: its sequence must capture only inside
    # capturing_ahead, and leave M = 288 step by step between the kept shapes' replays
    cache = GraphCache(torch.device("cpu"), 2, lambda backend, run: (Replayable(run), None))
    for m in (384, 320):
        drive([(m, 1)], cache=cache)
        with cache.capturing_ahead():
            x = torch.zeros(m, 2)
            cache.call((m, 1), 1, lambda: 0, x, (m, 2), CallSignature(m, 2, x.dtype, layer=1),
                       Backend(), lambda x_in, out: torch.mul(x_in, 3.0, out=out))
        assert drive([(m, 1)], cache=cache)[1] == ["replayed"]
    rounds = drive([(m, 1) for _ in range(12) for m in (384, 320, 288)], cache=cache)[1]
    assert rounds == ["replayed", "replayed", "eager"] * 12 and cache.captures == 2
