"""The token layout of replayed op calls (radiance_ar.transport.tokens) and the gates that
decide where the op replays (CPU: pure functions and the CPU world's refusal)."""

import itertools

import pytest
import torch

from radiance_ar import overlap
from radiance_ar.call_contract import CallSignature, PeerTimeoutError
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.transport import tokens
from radiance_ar.transport.call_streams import CallStreams
from radiance_ar.transport.signals import _HEADER as HEADER_WORDS, _word as signals_word
from radiance_ar.transport.signals import SLOT_BYTES
from radiance_ar.transport.world import single_world
from signal_fakes import StreamBlockedUntil, gpu_signals


@pytest.mark.parametrize("size", [2, 3, 8])
def test_every_token_has_its_own_word_inside_the_inbox(size):
    words = [tokens.word(kind, sender, k, size)
             for kind, sender, k in itertools.product(tokens.KINDS, range(size),
                                                      range(tokens.MAX_CALLS))]
    assert len(set(words)) == len(words)
    assert min(words) == 0 and (max(words) + 1) * tokens.WORD_BYTES == tokens.inbox_bytes(size)


def test_token_values_are_never_zero_and_tell_calls_apart():
    sigs = [CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, layer)
            for layer in (0, 1, 2)] + [CallSignature(97, 5120, torch.bfloat16)]
    values = [tokens.token_value(kind, k, sig) for kind in tokens.KINDS for k in range(8)
              for sig in sigs]
    assert 0 not in values and len(set(values)) == len(values)


def test_a_signature_keeps_its_layer_through_the_header_words():
    sig = CallSignature(96, 5120, torch.float16, "flags", 384, 4352, layer=1234)
    assert CallSignature.from_words(sig.words()) == sig
    assert "layer 1234" in sig.describe()


def test_a_graph_holds_at_most_max_calls():
    rnd = tokens.TokenRound()
    sig = CallSignature(1, 1, torch.bfloat16)
    for k in range(tokens.MAX_CALLS):
        assert rnd.begin(sig) == k
    with pytest.raises(ValueError, match="at most 64"):
        rnd.begin(sig)


def test_cpu_worlds_enqueue_each_call_and_say_why():
    rt = overlap.build(single_world("cpu"), OverlapSettings(True, "sdma", 1, 2))
    assert rt.graph_reason() == "one rank: the op's all-reduce is a copy"
    assert rt.graphs() is None
    w, v, other = torch.ones(4, 8), torch.ones(4, 8), torch.ones(1)  # all alive: distinct
    assert (rt.register_layer(w), rt.register_layer(v), rt.register_layer(w)) == (1, 2, 1)
    assert (rt.layer_number(w), rt.layer_number(v), rt.layer_number(other)) == (1, 2, 0)
    rt.close()


@pytest.mark.parametrize("size", [2, 4, 8])
def test_a_captured_pull_phase_waits_for_every_peer_in_one_batch(size):
    # One batched stream memory operation is one graph node, and each such node costs the
    # host about 2 us per replay: the W - 1 waits of a phase must not be W - 1 nodes.
    rank = 1
    signals, _, inbox, engine = gpu_signals(size, rank)
    sig = CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, 3)
    peers = [p for p in range(size) if p != rank]
    with signals.capture_round() as rnd, signals.call(sig):
        signals.wait_all(peers, "ready", signals.epoch, 7, "a test call")
    (stream, ops), = engine.batches
    value = tokens.token_value("ready", 0, sig)
    base = inbox.peer(rank).data_ptr()
    addrs = [base + tokens.word("ready", p, 0, size) * tokens.WORD_BYTES for p in peers]
    expected = [("wait_eq", a, value) for a in addrs] + [("write", a, 0) for a in addrs]
    assert stream == 7 and ops == expected  # every wait, then every reset
    assert [(a.peer, a.kind, a.k, a.value) for a in rnd.awaited] == [
        (p, "ready", 0, value) for p in peers]


def test_an_eager_pull_phase_waits_for_every_peer_in_one_batch():
    # The same phase outside a capture: each active peer's step tag (EQ), a passive peer's
    # done counter (GEQ, as a passive peer posts no steps), one stream operation call.
    size, rank = 4, 0
    signals, flags, _, engine = gpu_signals(size, rank)
    signals._passive = {3}
    sig = CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, 3)
    with signals.call(sig) as epoch:
        signals.wait_all([1, 2, 3], "ready", epoch, 7, "a test call")
        tag = signals.tag(epoch)
    (stream, ops), = engine.batches
    step = signals_word("ready", epoch) * SLOT_BYTES
    done = HEADER_WORDS["done"] * SLOT_BYTES
    assert stream == 7 and ops == [("wait_eq", flags.peer(1).data_ptr() + step, tag),
                                   ("wait_eq", flags.peer(2).data_ptr() + step, tag),
                                   ("wait_geq", flags.peer(3).data_ptr() + done, epoch)]


def test_the_done_tokens_left_at_a_graphs_end_are_consumed_in_one_batch():
    # A capture of three calls, each posting its done token to every peer and consuming
    # none: the round's end waits for (and resets) all 3 x (W - 1) tokens in ONE batch,
    # one graph node instead of three.
    size, rank = 4, 2
    signals, _, inbox, engine = gpu_signals(size, rank)
    peers = [p for p in range(size) if p != rank]
    sigs = [CallSignature(96 * (k + 1), 5120, torch.bfloat16, "flags", 384, 4352, 3)
            for k in range(3)]
    cpu = torch.device("cpu")
    ended = []
    with tokens.capture_round(signals, CallStreams(cpu, 1, None), peers, cpu,
                              lambda: ended.append(len(engine.batches))) as rnd:
        for sig in sigs:
            with signals.call(sig):
                signals.post("done", signals.epoch, 5)
    *posts, (stream, ops) = engine.batches
    assert len(posts) == 3 and all(what == "write" for _, batch in posts for what, _, _ in batch)
    base = inbox.peer(rank).data_ptr()
    waits, resets = [], []
    for k, sig in enumerate(sigs):
        value = tokens.token_value("done", k, sig)
        for p in peers:
            addr = base + tokens.word("done", p, k, size) * tokens.WORD_BYTES
            waits.append(("wait_eq", addr, value))
            resets.append(("write", addr, 0))
    assert stream == 0 and ops == waits + resets  # the capturing (current) stream
    assert rnd.unconsumed_done == {} and len(rnd.awaited) == 3 * (size - 1)
    assert rnd.end_event is None  # recorded by CUDA graphs only
    assert ended == [len(engine.batches)]  # the capture ends once, after the last batch


def test_a_timed_out_replay_releases_the_eager_fence_before_it_too():
    # An eager call's reuse fence (before_replay's), then a graph replayed, nothing checked
    # in between. The stream is blocked on both: the release must write the fence's done as
    # well as the graph's tokens, or the stream stays blocked after the error.
    size, rank = 3, 0
    signals, flags, inbox, _ = gpu_signals(size, rank, timeout_ms=20.0)
    sig = CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, 1)
    with signals.capture_round() as rnd, signals.call(sig):
        signals.wait_all([1, 2], "ready", signals.epoch, 7, "a test call")
    with signals.call(sig) as fence_epoch:
        signals.wait_all([1], "done", fence_epoch, 7, "the fence")
    peer_done = flags.peer(1).view(torch.int64)[HEADER_WORDS["done"]:HEADER_WORDS["done"] + 1]
    words = inbox.peer(rank).view(torch.int64)

    def released():
        return (int(peer_done) >= fence_epoch
                and all(int(words[a.index]) == a.value for a in rnd.awaited))

    rnd.end_event = StreamBlockedUntil(released)
    with signals.call(sig):
        signals.replayed(rnd, 7)
    with pytest.raises(PeerTimeoutError, match="did not complete it"):
        signals.check()
    assert released() and len(rnd.awaited) == 2
    assert int(flags.peer(rank).view(torch.int64)[HEADER_WORDS["abort"]]) > 0  # peers told


def test_why_calls_are_not_replayed_reaches_the_user_once(caplog):
    from radiance_ar.transport import world

    rt = overlap.build(single_world("cpu"), OverlapSettings(True, "sdma", 1, 2, graphs="on"))
    reason = rt.graph_reason()
    world._logged.clear()  # said at most once per process: this test says it again
    with caplog.at_level("INFO", logger="radiance_ar"):
        assert rt.graphs() is None and rt.graphs() is None
    said = [r for r in caplog.records if "not replayed" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"  # "on" asked for replays
    assert reason in said[0].getMessage()
    rt.close()


@pytest.mark.parametrize("fails", ["body", "end"])
def test_a_failed_capture_clears_its_mark_even_when_ending_the_capture_fails(fails):
    # The header's ``capturing`` word makes peers' replays wait up to 60 s for this rank's
    # capture. A capture that fails, in its body or in capture_end itself, must clear it,
    # or peers wait 60 s instead of the spin bound; and the capture ends once either way.
    signals, flags, _, _ = gpu_signals(2, 0)
    header = flags.peer(0).view(torch.int64)
    ended = []

    def end():
        ended.append(int(header[HEADER_WORDS["capturing"]]))
        if fails == "end":
            raise RuntimeError("capture_end failed")

    with pytest.raises(RuntimeError, match="failed"):
        with signals.capture_round(end):
            assert int(header[HEADER_WORDS["capturing"]]) == signals.epoch + 1
            if fails == "body":
                raise RuntimeError("the body failed")
    assert ended == [signals.epoch + 1]  # ended once, with the mark still up
    assert int(header[HEADER_WORDS["capturing"]]) == 0 and signals.round is None


def test_a_capture_that_ends_well_keeps_its_mark_for_the_replay():
    signals, flags, _, _ = gpu_signals(2, 0)
    header = flags.peer(0).view(torch.int64)
    with signals.capture_round(lambda: None):
        pass
    assert int(header[HEADER_WORDS["capturing"]]) == signals.epoch + 1  # peers may replay
    with signals.call(CallSignature(1, 1, torch.bfloat16)):  # the replay takes the number
        pass
    assert int(header[HEADER_WORDS["capturing"]]) == 0


def test_a_captured_phase_with_passive_peers_holds_the_operations_of_active_ones():
    """Timing mode: a passive peer posts no token, so its wait passes at once on its done
    word (PASSIVE_EPOCH), as in eager calls, and its reset writes 0 to its token's word:
    the timed graph has the node and the operations a graph of active peers has."""
    from radiance_ar.transport.signals import PASSIVE_EPOCH

    size, rank = 4, 0
    sig = CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, 3)
    counts = []
    for passive in (set(), {2, 3}):
        signals, flags, inbox, engine = gpu_signals(size, rank)
        for p in passive:
            signals.set_passive(p)
        with signals.capture_round() as rnd, signals.call(sig):
            signals.wait_all([1, 2, 3], "ready", signals.epoch, 7, "a test call")
        (stream, ops), = engine.batches
        counts.append(([op[0] for op in ops], len(rnd.awaited)))
        if passive:
            done = HEADER_WORDS["done"] * SLOT_BYTES
            assert ("wait_geq", flags.peer(2).data_ptr() + done, 1) in ops
            assert flags.peer(2)[done:done + 4].view(torch.int32).item() == PASSIVE_EPOCH
    active, timed = counts
    # as many operations, as many waits (EQ on a token, GEQ on a passive done) and resets
    assert len(active[0]) == len(timed[0]) == 6
    assert active[0].count("write") == timed[0].count("write") == 3
    assert (active[1], timed[1]) == (3, 1)  # only active peers' waits are bounded by check


@pytest.mark.parametrize("then", ["an eager call", "another graph"])
def test_a_blocked_replay_is_released_whatever_was_enqueued_after_it(then):
    """Rank 0 of 2 replays a graph whose peer never posts, then enqueues an eager call or
    another graph's replay, and checks. The stream passes its waits in order, each token
    reset once consumed; check() must raise AND leave the stream finished, writing each
    graph's tokens in turn (graphs share inbox words with other values: writing only the
    last graph's never frees the first)."""
    from signal_fakes import StreamBlockedUntil

    from radiance_ar.transport.signals import _word

    signals, flags, inbox, _ = gpu_signals(2, 0, timeout_ms=20.0)
    words = inbox.peer(0).view(torch.int64)
    order, passed = [], [0]

    def stream_done():
        while passed[0] < len(order):
            kind, item = order[passed[0]]
            if kind == "tokens":
                if not all(int(words[a.index]) == a.value for a in item):
                    return False
                for a in item:
                    words[a.index] = 0
            elif not item():
                return False
            passed[0] += 1
        return True

    def replay(layer):
        sig = CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, layer)
        with signals.capture_round() as rnd, signals.call(sig):
            signals.wait_all([1], "ready", signals.epoch, 7, "graph")
        rnd.end_event = StreamBlockedUntil(stream_done)
        order.append(("tokens", rnd.awaited))
        with signals.call(sig):
            signals.replayed(rnd, 7)

    replay(1)
    if then == "another graph":
        replay(2)
    else:
        peer = flags.peer(1).view(torch.int64)
        with signals.call(CallSignature(32, 5120, torch.bfloat16)) as t:
            signals.wait_all([1], "ready", t, 7, "eager call")
            tag = signals.tag(t)
        order.append(("eager", lambda: int(peer[_word("ready", t)]) & 0xFFFFFFFF == tag))
        signals.EVENT_TYPE = lambda: StreamBlockedUntil(stream_done)
        signals.end_call(7)
    with pytest.raises(PeerTimeoutError, match="peer rank 1 did not"):
        signals.check()
    assert stream_done(), "the stream is still blocked"


def test_an_eager_call_inside_a_callers_capture_is_refused(monkeypatch):
    """A backend's all_reduce made directly inside someone's CUDA graph (not through the
    op, whose captured calls use tokens) would bake in numbered tags that every replay
    repeats: refused before it takes a number."""
    signals, _, _, engine = gpu_signals(2, 0)
    engine.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="called directly inside a CUDA-graph capture"):
        with signals.call(CallSignature(8, 256, torch.bfloat16)):
            pass
    assert signals.epoch == 0
    with signals.capture_round(), signals.call(CallSignature(8, 256, torch.bfloat16)):
        pass  # inside the op's own round: tokens


def test_a_graph_holds_every_slice_the_knob_allows():
    from radiance_ar.envs import MAX_OVERLAP_SLICES

    assert tokens.MAX_CALLS >= MAX_OVERLAP_SLICES
