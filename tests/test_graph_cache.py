"""The policy of the op's graph cache (radiance_ar.overlap.graphs.GraphCache) on the CPU:
a "graph" here re-runs the captured body on the persistent buffers when replayed, which
is what a CUDA graph does on a GPU (tests/test_graphs_gpu.py runs the real ones)."""

import contextlib

import pytest
import torch

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
    def replay_call(self, sig, rnd):
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


def test_a_dropped_graph_takes_its_persistent_buffers_with_it():
    cache, backend, bodies = make(limit=2)
    shapes = {"a": (8, 4), "b": (16, 5), "c": (32, 6)}  # no two share a persistent buffer
    # each key: eager, then captured at its second call, except c: as often called as b
    # lately, it runs step by step until it is called twice as often (the room's rule)
    for key, calls in (("a", 2), ("b", 2), ("a", 2), ("c", 4)):
        x = torch.randn(*shapes[key])
        for _ in range(calls):
            assert torch.equal(call(cache, backend, key, x, body_for(bodies, 2.0)), x * 2.0)
    assert list(cache.room._kept) == ["a", "c"]  # b: as often called as a, used less lately
    assert cache.captures == 3
    held = cache.memory()["static_bytes"]
    assert held == sum(2 * r * c * 4 for r, c in (shapes["a"], shapes["c"]))


def test_every_m_up_to_a_power_of_two_binds_one_buffer_and_none_is_dropped_for_another():
    cache, backend, bodies = make(limit=8)
    xs = {m: [torch.randn(m, 3) for _ in range(3)] for m in (6, 10, 5, 16)}
    for m in (6, 10, 5, 16):  # eager, captured and replayed, replayed
        for x in xs[m]:
            assert torch.equal(call(cache, backend, ("k", m), x, body_for(bodies, 5.0)), x * 5.0)
    x_of = {m: cache.room.get(("k", m)).x for m in xs}
    assert x_of[6].data_ptr() == x_of[5].data_ptr() != x_of[10].data_ptr() == x_of[16].data_ptr()
    assert (cache.captures, len(cache)) == (4, 4)  # a larger M dropped no graph
    assert cache.memory()["static_bytes"] == 2 * (8 + 16) * 3 * 4
    for m in xs:  # every graph still replays right
        x = torch.randn(m, 3)
        assert torch.equal(call(cache, backend, ("k", m), x, body_for(bodies, 5.0)), x * 5.0)
    assert cache.captures == 4


def test_the_keys_remembered_as_warmed_up_are_bounded(monkeypatch):
    monkeypatch.setattr(GraphCache, "SEEN_KEYS", 5)
    cache, backend, bodies = make(per_layer=1, limit=1)
    x = torch.randn(2, 2)
    for key in range(20):
        call(cache, backend, key, x, body_for(bodies, 1.0))
    assert list(cache._seen) == list(range(15, 20))


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



def test_a_capture_after_a_new_generation_finds_its_pool_held(monkeypatch):
    """GraphCache.capture_cuda_graph with torch's graph classes replaced by a model of
    its private pools (CUDACachingAllocator: a capture into a pool that exists but no
    live graph holds fails an internal assert; a graph's end releases its hold). Growth
    or a resync drops every graph; the next capture must still find the pool held, and
    once it does, the dropped graphs go."""
    from radiance_ar.overlap import graphs

    held: dict = {}  # pool -> live graphs holding it (an entry stays at 0, as torch's does)

    class PoolGraph:
        def capture_begin(self, pool, capture_error_mode):
            assert capture_error_mode == "thread_local"
            if held.get(pool, 1) <= 0:
                raise RuntimeError("INTERNAL ASSERT FAILED: it->second->use_count > 0")
            held[pool] = held.get(pool, 0) + 1
            self.pool = pool

        def capture_end(self):
            pass

        def __del__(self):
            held[self.pool] -= 1

    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", PoolGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (1, next(handles)))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(graphs, "dedicated_stream", lambda device: None)

    class RoundBackend(Backend):
        @contextlib.contextmanager
        def capture_round(self, end):
            try:
                yield "round"
            finally:
                end()

    backend, cache = RoundBackend(), GraphCache(torch.device("cpu"), 4)
    captured = cache.capture_cuda_graph

    def capture(be, run):  # the real capture; the model's graph then replays the body
        graph, rnd = captured(be, run)
        graph.replay = run
        return graph, rnd

    cache._capture_graph = capture
    body, x = body_for([], 2.0), torch.randn(6, 3)
    for generation in (0, 0, 0, 1, 1, 1):  # eager, captured, replayed; growth; again
        assert torch.equal(call(cache, backend, "a", x, body, generation), x * 2.0)
    assert (cache.captures, cache.replays) == (2, 4)  # a capturing call replays too
    assert held == {(1, 0): 1}  # one pool, held by the live graph alone
    cache.clear()
    assert held == {(1, 0): 0}
