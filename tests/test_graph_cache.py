"""The policy of the op's graph cache (radiance_ar.overlap.graphs.GraphCache) on the CPU:
a "graph" here re-runs the captured body on the persistent buffers when replayed, which
is what a CUDA graph does on a GPU (tests/test_graphs_gpu.py runs the real ones)."""

import contextlib
import random

import pytest
import torch

from radiance_ar import envs
from radiance_ar.call_contract import CallSignature
from radiance_ar.overlap.graphs import GraphCache


class Replayable:
    def __init__(self, run):
        self.replay = run


class Backend:
    """Counts replays the way TransportBackend.replay_call brackets them."""

    def __init__(self):
        self.replayed = []

    @contextlib.contextmanager
    def replay_call(self, sig, rnd, stream):
        yield
        self.replayed.append((sig, rnd))


def make(per_layer=4, limit=4):
    backend, bodies = Backend(), []

    def capture(be, run):
        assert be is backend
        return Replayable(run), f"round {len(bodies)}"

    return GraphCache(torch.device("cpu"), per_layer, capture, limit), backend, bodies


def body_for(bodies, scale):
    def body(x, out):
        bodies.append(x.data_ptr())
        torch.mul(x, scale, out=out)
    return body


def call(cache, backend, key, x, body, generation=0, layer=None):
    """One op call of ``key``, in a layer of its own unless ``layer`` is given."""
    sig = CallSignature(x.shape[0], x.shape[1], x.dtype, layer=layer or 0)
    return cache.call(key, key if layer is None else layer, lambda: generation, x,
                      tuple(x.shape), sig, backend, body)


def test_eager_then_captured_then_replayed_with_new_inputs_each_time():
    cache, backend, bodies = make()
    body = body_for(bodies, 3.0)
    xs = [torch.randn(5, 4) for _ in range(4)]
    outs = [call(cache, backend, "a", x, body) for x in xs]
    for x, out in zip(xs, outs):
        assert torch.equal(out, x * 3.0)
    assert (cache.captures, cache.replays, len(backend.replayed)) == (1, 3, 3)
    assert bodies[0] == xs[0].data_ptr()  # the eager call reads the caller's x
    assert len(set(bodies[1:])) == 1  # every replay reads the one persistent input
    outs[2].zero_()  # a returned output is the caller's own: later replays leave it alone
    call(cache, backend, "a", xs[0], body)
    assert torch.equal(outs[3], xs[3] * 3.0)


def test_capturing_ahead_captures_without_replaying_and_the_next_call_replays():
    # emulated ranks' rule 3 (radiance_ar.harness.emulated): every rank captures, then replays
    cache, backend, bodies = make()
    body = body_for(bodies, 2.0)
    xs = [torch.randn(4, 3) for _ in range(3)]
    assert torch.equal(call(cache, backend, "a", xs[0], body), xs[0] * 2.0)  # eager
    with cache.capturing_ahead():
        assert call(cache, backend, "a", xs[1], body) is None
    assert (cache.captures, cache.replays, len(backend.replayed), len(bodies)) == (1, 0, 0, 1)
    assert torch.equal(call(cache, backend, "a", xs[2], body), xs[2] * 2.0)
    assert (cache.captures, cache.replays, len(backend.replayed)) == (1, 1, 1)


def test_capturing_ahead_refuses_a_call_not_due_for_capture_and_runs_nothing():
    cache, backend, bodies = make()
    body = body_for(bodies, 1.0)
    x = torch.randn(2, 2)
    with pytest.raises(ValueError, match="not run eagerly first"), cache.capturing_ahead():
        call(cache, backend, "a", x, body)
    assert (len(bodies), cache.captures, len(cache)) == (0, 0, 0)
    call(cache, backend, "a", x, body)  # eager
    call(cache, backend, "a", x, body)  # captured and replayed
    with pytest.raises(ValueError, match="captured already"), cache.capturing_ahead():
        call(cache, backend, "a", x, body)
    with pytest.raises(ValueError, match="already capturing ahead"), cache.capturing_ahead():
        with cache.capturing_ahead():
            pass
    with pytest.raises(ValueError, match="0 captures in the block, expected 1"), \
            cache.capturing_ahead():
        pass  # e.g. a call below min_m, or one on another runtime's cache
    assert (cache.captures, cache.replays) == (1, 1)
    assert torch.equal(call(cache, backend, "a", x, body), x)  # out of the block: replays
    assert cache.replays == 2
    call(cache, backend, "b", x, body)
    call(cache, backend, "c", x, body)
    with pytest.raises(ValueError, match="2 captures in the block"), cache.capturing_ahead():
        call(cache, backend, "b", x, body)
        call(cache, backend, "c", x, body)


def test_a_new_generation_drops_every_graph_and_starts_eagerly_again():
    cache, backend, bodies = make()
    body = body_for(bodies, 1.0)
    x = torch.randn(3, 2)
    for _ in range(3):
        call(cache, backend, "a", x, body, generation=0)
    assert (cache.captures, len(cache)) == (1, 1)
    call(cache, backend, "a", x, body, generation=1)  # buffers moved: eager warm-up again
    assert (cache.captures, len(cache)) == (1, 0)
    call(cache, backend, "a", x, body, generation=1)
    assert (cache.captures, len(cache)) == (2, 1)


def test_least_recently_used_goes_first_with_its_persistent_buffers():
    cache, backend, bodies = make(limit=2)
    shapes = {"a": (8, 4), "b": (16, 5), "c": (32, 6)}  # no two share a persistent buffer
    # each key: eager, then captured at its second call; c, as often called as b at its
    # second, runs step by step, and takes b's room at its third (called more often lately)
    for key, calls in (("a", 2), ("b", 2), ("a", 2), ("c", 3)):
        x = torch.randn(*shapes[key])
        for _ in range(calls):
            assert torch.equal(call(cache, backend, key, x, body_for(bodies, 2.0)), x * 2.0)
    assert list(cache._entries) == ["a", "c"]  # b was least recently used
    assert (cache.captures, cache.crowded_out) == (3, 0)  # called twice: maybe a one-off
    held = cache.memory()["static_bytes"]
    assert held == sum(2 * r * c * 4 for r, c in (shapes["a"], shapes["c"]))


def test_every_m_binds_the_first_rows_of_one_buffer_which_grows_to_the_largest():
    cache, backend, bodies = make(limit=8)
    xs = {m: [torch.randn(m, 3) for _ in range(4)] for m in (6, 10, 4)}

    def calls(m, n):
        for x in xs[m][:n]:
            assert torch.equal(call(cache, backend, ("k", m), x, body_for(bodies, 5.0)), x * 5.0)

    calls(6, 3)  # eager, captured and replayed, replayed
    six = cache._entries[("k", 6)]
    calls(4, 3)  # fewer rows: the same buffers
    assert cache._entries[("k", 4)].x.data_ptr() == six.x.data_ptr()
    assert cache.memory()["static_bytes"] == 2 * 6 * 3 * 4
    calls(10, 2)  # more rows: the buffers grow, the graphs bound to the old ones go
    assert list(cache._entries) == [("k", 10)] and cache.captures == 3
    assert cache.memory()["static_bytes"] == 2 * 10 * 3 * 4
    calls(6, 4)  # captured again on the grown buffers (not a recapture: nothing was full)
    calls(4, 4)
    assert (cache.captures, cache.recaptures, len(cache)) == (5, 0, 3)
    assert len({e.x.data_ptr() for e in cache._entries.values()}) == 1


def test_the_keys_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(GraphCache, "SEEN_KEYS", 5)
    cache, backend, bodies = make(per_layer=1, limit=1)
    x = torch.randn(2, 2)
    for key in range(20):
        call(cache, backend, key, x, body_for(bodies, 1.0))
    assert list(cache._seen) == list(range(15, 20))


@pytest.mark.parametrize("rows, captured", [((12, 8), 320), ((8, 12), 480)])
def test_a_model_with_two_recurring_m_values_replays_every_call_after_its_captures(rows, captured):
    # Llama-3.1-70B at TP 4 routes 160 linears (80 layers: o_proj, down_proj); a chunked
    # prefill alternates a full chunk with a remainder that comes back. A process-wide LRU
    # of 256 graphs dropped each graph before its next use (2880 captures in 3200 calls);
    # the default quota of 4 graphs per layer keeps all 320. Where the smaller M is captured
    # first, the larger grows the persistent buffers once, and the smaller M's graphs are
    # captured again once (160 more).
    per_layer = envs.KNOBS["RADIANCE_AR_OP_GRAPHS_PER_LAYER"].default
    cache, backend, bodies = make(per_layer=per_layer, limit=envs.MAX_OP_GRAPHS)
    rounds, layers = 10, 160
    for n in range(rounds):
        for m in rows:
            for layer in range(1, layers + 1):
                x = torch.full((m, 2), float(layer))
                out = call(cache, backend, (m, layer), x, body_for(bodies, 2.0), layer=layer)
                assert torch.equal(out, x * 2.0)
        if n == 2:
            after_warm_up = cache.captures
    calls = rounds * len(rows) * layers
    assert (cache.captures, after_warm_up, cache.recaptures) == (captured, captured, 0)
    assert cache.replays == calls - len(rows) * layers  # every call but the first of each key
    assert len(cache) == 320 and cache.memory()["static_bytes"] == 2 * max(rows) * 2 * 4


def test_a_layer_over_its_quota_keeps_its_most_called_graphs_and_says_so_once(caplog):
    cache, backend, bodies = make(per_layer=2, limit=64)
    other = torch.randn(4, 3)
    for _ in range(2):
        call(cache, backend, "other", other, body_for(bodies, 1.0), layer=9)

    def layer_7(rows, rounds):
        for _ in range(rounds):
            for m in rows:
                x = torch.randn(m, 2)
                assert torch.equal(call(cache, backend, ("L7", m), x, body_for(bodies, 3.0),
                                        layer=7), x * 3.0)

    # three shapes of layer 7 recur in turn, two graphs kept: the third, called as often as
    # the graph it would drop, runs step by step (an LRU would drop and capture one at every
    # call); never a capture for a graph dropped before. Crowded out from its third call
    # (RECURRING_CALLS): at its second it may be a one-off that came back once
    layer_7((5, 3, 2), 4)
    assert sorted(k for k in cache._entries if k != "other") == [("L7", 3), ("L7", 5)]
    assert (cache.captures, cache.recaptures, cache.crowded_out) == (1 + 2, 0, 2)
    warned = [r for r in caplog.records if "radiance-ar op graphs" in r.message]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    assert "layer 7 with 2 rows recur as often as" in warned[0].message
    assert "RADIANCE_AR_OP_GRAPHS_PER_LAYER" in warned[0].message
    # M = 5 stops coming: M = 2, now called more often lately, takes its room; M = 5 back
    # and called more often than M = 3 takes M = 3's: a recapture, warned once too
    layer_7((3, 2), 2)
    assert sorted(k for k in cache._entries if k != "other") == [("L7", 2), ("L7", 3)]
    layer_7((5,), 7)
    assert sorted(k for k in cache._entries if k != "other") == [("L7", 2), ("L7", 5)]
    assert "other" in cache._entries  # another layer's graph is never dropped for layer 7
    assert (cache.recaptures, len(caplog.records)) == (1, 2)
    assert "a graph dropped for room was captured again (layer 7, 5 rows)" in caplog.records[1].message


@pytest.mark.parametrize("per_layer, limit, named", [(0, 8, "per_layer 0"), (2, 0, "limit 0"),
                                                     (True, 8, "per_layer True")])
def test_quota_and_limit_are_checked(per_layer, limit, named):
    with pytest.raises(ValueError, match=named):
        GraphCache(torch.device("cpu"), per_layer, limit=limit)


@pytest.mark.parametrize("fails", [None, "begin", "body", "end"])
def test_a_capture_is_ended_exactly_once_on_every_path(monkeypatch, fails):
    # capture_cuda_graph hands capture_end to the backend's round, which ends the capture
    # (and undoes its marks if that fails); a round that never began leaves it to the cache.
    # torch.cuda's capture calls stand in here (no GPU), the cache's protocol is the real one.
    from radiance_ar.overlap import graphs
    state = {"capturing": False, "ends": 0}

    class Graph:
        def capture_begin(self, pool, capture_error_mode):
            state["capturing"] = True

        def capture_end(self):
            state["capturing"], state["ends"] = False, state["ends"] + 1
            if fails == "end":
                raise RuntimeError("capture_end failed")

    class RoundBackend:
        @contextlib.contextmanager
        def capture_round(self, end):
            if fails == "begin":
                raise TypeError("the round could not begin")
            try:
                yield "round"
            finally:
                end()

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(graphs, "dedicated_stream", lambda device: "capture stream")

    def run():
        if fails == "body":
            raise RuntimeError("the body failed")

    cache = GraphCache(torch.device("cpu"), 2)
    if fails is None:
        assert cache.capture_cuda_graph(RoundBackend(), run)[1] == "round"
    else:
        with pytest.raises((RuntimeError, TypeError), match="failed|could not begin"):
            cache.capture_cuda_graph(RoundBackend(), run)
    assert state == {"capturing": False, "ends": 1}


def test_thousands_of_calls_of_varying_m_hold_bounded_memory_and_keep_the_recurring_graphs(
        monkeypatch):
    # a chunked prefill under light load: two recurring M values (a full chunk and a
    # remainder that comes back) and, 30% of the time, an M that may never recur
    monkeypatch.setattr(GraphCache, "SEEN_KEYS", 64)
    cache, backend, bodies = make(per_layer=4, limit=4096)
    rng, layers, hot, widest = random.Random(0), 3, (64, 48), 80
    for step in range(1500):
        m = hot[step % 2] if rng.random() < 0.7 else rng.randint(16, widest)
        for layer in range(1, layers + 1):
            x = torch.full((m, 2), float(step))
            out = call(cache, backend, (m, layer), x, body_for(bodies, 1.0), layer=layer)
            assert torch.equal(out, x), (step, layer, m)
        assert len(cache) <= 4 * layers and len(cache._seen) <= 64 and len(cache._dropped) <= 64
        assert cache.memory()["static_bytes"] <= 2 * widest * 2 * 4
        # a recurring shape's graph is never dropped for room (the buffers' growth drops
        # graphs, not for room: they are captured again, uncounted)
        assert not any(key[0] in hot for key in cache._dropped), step
    # the recurring shapes keep their graphs in every layer: their calls replay
    assert all((m, layer) in cache._entries for m in hot for layer in range(1, layers + 1))
    # a one-off M that comes back runs step by step unless it comes more often lately than
    # the graph it would drop: 230 captures here, most of them one-off M values taking each
    # other's room; a plain LRU made 1437, 246 of them the recurring M values' graphs again
    assert cache.captures < 300


def test_call_counts_halve_every_window_and_keys_called_once_leave(monkeypatch):
    monkeypatch.setattr(GraphCache, "USES_WINDOW_PER_GRAPH", 3)  # 2 graphs at most: 6 calls
    cache, backend, bodies = make(per_layer=2)
    x = torch.randn(2, 2)
    for key in ("a", "a", "a", "a", "b"):
        call(cache, backend, key, x, body_for(bodies, 1.0))
    assert cache._uses == {"a": 4, "b": 1}
    call(cache, backend, "c", x, body_for(bodies, 1.0))  # the sixth call: every count halves
    assert cache._uses == {"a": 2}


def test_a_sweep_of_m_values_larger_than_the_quota_captures_each_within_a_few_calls():
    # a benchmark that runs 23 calls of each M, largest first, through one layer: a shape
    # that stops coming yields its room once the counts of calls halve (10 calls per graph)
    cache, backend, bodies = make(per_layer=4, limit=64)
    for m in range(15, 7, -1):
        for n in range(23):
            x = torch.randn(m, 2)
            assert torch.equal(call(cache, backend, m, x, body_for(bodies, 1.0), layer=1), x)
    eager = 8 * 23 - cache.replays
    assert (cache.captures, eager) == (8, 24)  # the first call of each, and a few refused
