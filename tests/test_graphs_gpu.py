"""The op's sliced path captured once per shape and replayed (radiance_ar.overlap.graphs),
on emulated ranks of one GPU: results against float64 with new inputs at every call, the
same bits on every rank, one capture per shape, memory flat, and the call contract: a
rank in another layer (a skipped call) raises on every rank, which resync recovers (its
shapes captured again, into the pool the dropped graphs held). Every rank captures before
any rank replays (EmulatedRanks.capture_ahead: one host thread drives every rank, and a
capture made while a peer's replay waits on this rank can block)."""

import pytest
import torch

from radiance_ar import overlap
import world_jobs
from radiance_ar.call_contract import CollectiveError
from radiance_ar.envs import BackendSettings
from radiance_ar.harness.emulated import EmulatedRanks
from radiance_ar.overlap.config import OverlapSettings

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
DT = torch.bfloat16
BOUND = {"sdma": 2 ** -7, "sdma_wht6": 0.07}


def build(ranks, backend, slices, schedule="auto", timeout_ms=1000.0, per_layer=4):
    # "on": auto declines emulated ranks with active peers (TransportBackend.replay_reason)
    settings = OverlapSettings(True, backend, 1, slices,
                               BackendSettings(sdma_schedule=schedule, spin_timeout_ms=timeout_ms),
                               graphs="on", graphs_per_layer=per_layer)
    rts = [overlap.build(w, settings) for w in ranks.worlds]
    reason = rts[0].graph_reason()
    if reason is not None:  # ROCm: host-memory worlds are not captured (hip_capture_reason)
        for rt in rts:
            rt.close()
        pytest.skip(reason)
    return rts


def capture_ahead(ranks, rts, shards):
    """Every rank's graph of this call captured before any rank replays it (the next
    emulated_forward replays)."""
    ranks.capture_ahead([rt.graphs() for rt in rts],
                        lambda r: overlap.forward(rts[r], *shards[r], None, "bf16"))


@pytest.mark.parametrize("size,backend,schedule", [(2, "sdma", "oneshot"), (4, "sdma", "twoshot"),
                                                   (2, "sdma_wht6", "auto"),
                                                   (4, "sdma_wht6", "twoshot")])
def test_replayed_calls_are_right_with_new_inputs_every_call(size, backend, schedule, release):
    rows, cols, k = 384, 1024, 256
    ranks = EmulatedRanks(size, DEV)
    rts = build(ranks, backend, 4, schedule)
    release.extend(rt.backend for rt in rts)
    ranks.prepare(lambda r: rts[r].backend.ensure_capacity(rows, cols, DT))
    weights = [world_jobs.device_shards(0, size, rows, cols, k, DEV)[r][1] for r in range(size)]
    for rt, w in zip(rts, weights):
        rt.register_layer(w)
    for call in range(8):
        seed = 10 + call
        shards = world_jobs.device_shards(seed, size, rows, cols, k, DEV)
        shards = [(x, w) for (x, _), w in zip(shards, weights)]
        if call == 1:
            capture_ahead(ranks, rts, shards)
        outs = world_jobs.emulated_forward(ranks, rts, shards, 5000)
        ref = sum(x.double().cpu() @ w.double().cpu().t() for x, w in shards)
        for r, out in enumerate(outs):
            err = float((out.double().cpu() - ref).norm() / ref.norm())
            assert err < BOUND[backend], (call, r, err)
            assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16)), (call, r)
        if call == 2:
            memory = [torch.cuda.memory_allocated(DEV), [rt.graphs().memory() for rt in rts]]
    assert [torch.cuda.memory_allocated(DEV), [rt.graphs().memory() for rt in rts]] == memory
    for rt in rts:  # call 0 eager, call 1 captured ahead and replayed, then replays only
        assert (rt.graphs().captures, rt.graphs().replays) == (1, 7)
    for rt in rts:
        rt.close()


@pytest.mark.parametrize("backend", ["sdma", "sdma_wht6"])
def test_shapes_of_one_layer_share_buffers_and_a_refused_one_runs_between_their_replays(
        backend, release):
    # two graphs a layer: M = 384 and 320 are kept and bind the first rows of one persistent
    # pair (both round up to 512 rows); M = 288, called less often, runs step by step
    # between their replays (test_graph_room.test_the_gpu_tests_sequence_captures_only_ahead:
    # nothing else is captured, so no capture happens while a peer's replay waits)
    size, cols, k = 2, 1024, 256
    ranks = EmulatedRanks(size, DEV)
    rts = build(ranks, backend, 4, per_layer=2)
    release.extend(rt.backend for rt in rts)
    ranks.prepare(lambda r: rts[r].backend.ensure_capacity(384, cols, DT))
    weights = [world_jobs.device_shards(0, size, 8, cols, k, DEV)[r][1] for r in range(size)]
    for rt, w in zip(rts, weights):
        rt.register_layer(w)
    seed = iter(range(100, 200))

    def step(rows, ahead=False):
        shards = [(x, w) for (x, _), w in zip(
            world_jobs.device_shards(next(seed), size, rows, cols, k, DEV), weights)]
        if ahead:
            capture_ahead(ranks, rts, shards)
        outs = world_jobs.emulated_forward(ranks, rts, shards, 5000)
        ref = sum(x.double().cpu() @ w.double().cpu().t() for x, w in shards)
        for r, out in enumerate(outs):
            assert float((out.double().cpu() - ref).norm() / ref.norm()) < BOUND[backend], rows
            assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16)), (rows, r)

    for rows in (384, 320):  # eager, captured ahead and replayed
        step(rows)
        step(rows, ahead=True)
    for _ in range(12):
        for rows in (384, 320, 288):
            step(rows)
    for rt in rts:
        graphs = rt.graphs()
        assert (graphs.captures, graphs.replays, len(graphs)) == (2, 2 + 24, 2)
        assert graphs.room.crowded_out > 0
        kept = list(graphs.room.values())
        assert kept[0].x.data_ptr() == kept[1].x.data_ptr()  # one persistent input
    for rt in rts:
        rt.close()


def test_a_rank_in_another_layer_raises_on_every_rank_and_resync_recovers(release):
    size, rows, cols, k = 2, 256, 512, 256
    ranks = EmulatedRanks(size, DEV)
    rts = build(ranks, "sdma", 2, "oneshot", timeout_ms=300.0)
    release.extend(rt.backend for rt in rts)
    ranks.prepare(lambda r: rts[r].backend.ensure_capacity(rows, cols, DT))
    layers = [world_jobs.device_shards(seed, size, rows, cols, k, DEV) for seed in (1, 2)]
    for rt, r in zip(rts, range(size)):
        for shards in layers:
            rt.register_layer(shards[r][1])
    def in_step():
        """Three calls of both layers on every rank: eager, captured (ahead) and replayed,
        replayed; every result against float64."""
        for i in range(3):
            for seed, shards in enumerate(layers, start=1):
                if i == 1:
                    capture_ahead(ranks, rts, shards)
                outs = world_jobs.emulated_forward(ranks, rts, shards, 5000)
                ref = world_jobs.reference(seed, size, rows, cols, k)
                for out in outs:
                    assert float((out.double().cpu() - ref).norm() / ref.norm()) < 2 ** -7

    in_step()
    assert [rt.graphs().captures for rt in rts] == [2, 2]
    # rank 1 skips layer 1's call: it runs layer 2 while rank 0 runs layer 1
    ranks.each(lambda r: overlap.forward(rts[r], *layers[r][r], None, "bf16"))
    raised = []
    for rt in rts:
        with pytest.raises(CollectiveError) as info:
            rt.backend.check()
        raised.append(str(info.value))
    assert any("layer" in m for m in raised), raised
    torch.cuda.synchronize()
    for rt in rts:
        rt.backend.resync()
    # a resync is a new generation: every graph dropped, each shape run eagerly and
    # captured again, into the private pool its retired graphs still held
    in_step()
    assert [rt.graphs().captures for rt in rts] == [4, 4]
    for rt in rts:
        rt.close()
