"""The oneshot_wht6 backend: the protocol in CPU worlds of real processes, the fused kernel
under the Triton interpreter, and W emulated ranks on one GPU (marked ``gpu``)."""

import importlib.util
import random
import time

# conftest.py sets the CUDA driver variables emulated ranks need (envs.EMULATED_RANKS_CUDA_ENV).
import pytest  # noqa: E402
import torch  # noqa: E402

from radiance_ar import backends  # noqa: E402
from interpreter import run_under_interpreter  # noqa: E402
import oneshot_jobs as jobs  # noqa: E402
import world_jobs  # noqa: E402
from radiance_ar import overlap  # noqa: E402
from radiance_ar.envs import BackendSettings  # noqa: E402
from radiance_ar.backends.oneshot_wht6 import OneshotWht6Backend  # noqa: E402
from radiance_ar.transport.signals import PeerTimeoutError  # noqa: E402
from radiance_ar.transport.world import World, single_world  # noqa: E402
from radiance_ar.harness.emulated import EmulatedRanks  # noqa: E402
from radiance_ar.overlap.config import OverlapSettings  # noqa: E402
from radiance_ar.overlap.slicing import slice_bounds  # noqa: E402

DT = torch.bfloat16
BOUND = OneshotWht6Backend.rel_rms_bound
SHAPES = [(1, 256), (5, 512), (16, 1280), (7, 768), (33, 256)]


# ------------------------------------------------------------------ CPU worlds

@pytest.mark.parametrize("size", [2, 3, 4])
def test_accurate_identical_and_wire_bytes(cpu_world, size):
    pool = cpu_world(size)
    for slices in (1, 3):
        per_rank = pool.run(jobs.slices_job, SHAPES, slices, 11)
        for call, (rows, cols) in enumerate(SHAPES):
            outs = [per_rank[r][call][0] for r in range(size)]
            ref = jobs.reference(11, call, size, rows, cols)
            for r, out in enumerate(outs):
                assert not torch.isnan(out).any(), (size, rows, cols, r)  # every element written
                assert world_jobs.rel_rms(out, ref) < BOUND, (size, rows, cols, r)
                assert torch.equal(jobs.bits(out), jobs.bits(outs[0])), (size, rows, cols, r)
            # Bytes moved: each rank read every peer's payload of every slice once.
            bounds = slice_bounds(rows, slices)
            moved = (size - 1) * sum(jobs.payload_bytes(b - a, cols)
                                     for a, b in zip(bounds[:-1], bounds[1:]))
            assert [per_rank[r][call][1] for r in range(size)] == [moved] * size
            assert [per_rank[r][call][2] for r in range(size)] == [moved] * size


def test_200_calls_of_varying_shape_no_stale_flags(cpu_world):
    results = cpu_world(3).run(jobs.long_job, 200, 3)
    for r, res in enumerate(results):
        assert res["bad"] == [], f"rank {r} wrong at calls {res['bad']}"
    assert all(res["hashes"] == results[0]["hashes"] for res in results)


def test_passive_peers_hold_valid_payloads_at_both_parities(cpu_world):
    assert cpu_world(3).run(jobs.passive_job, 37, 512)[0] == [True] * 3


@pytest.mark.parametrize("size", [2, 4])
def test_through_the_overlap_op(cpu_world, size):
    rows, cols, k, seed = 29, 256, 48, 4
    slice_counts = [1, 2, 4]
    per_rank = cpu_world(size).run(jobs.op_job, rows, cols, k, slice_counts, seed)
    ref = world_jobs.reference(seed, size, rows, cols, k)
    for r, outs in enumerate(per_rank):
        assert len(outs) == 2 * len(slice_counts)
        for i, out in enumerate(outs):
            assert world_jobs.rel_rms(out, ref) < BOUND, (r, slice_counts[i // 2])
            # Same slicing, any rank, any repetition: the same bits.
            assert torch.equal(jobs.bits(out), jobs.bits(per_rank[0][i - i % 2])), (r, i)


# ------------------------------------------------------------------ no world

def test_registry_capabilities_and_wire_bytes():
    assert backends.get("r4d") is OneshotWht6Backend is backends.get("oneshot_wht6")
    be = OneshotWht6Backend(single_world())
    assert be.uses_compute_units_while_waiting and be.capture_safe and not be.bit_exact
    assert be.wire_bytes(5120, 4) == 3 * 4000 and be.wire_bytes(5120, 1) == 0
    assert be.wire_bytes(3 * 256, 2) == 3 * 200


def test_single_rank_is_a_copy():
    be = OneshotWht6Backend(single_world())
    x = torch.randn(3, 256).to(DT)
    out = torch.full_like(x, float("nan"))
    be.all_reduce(x, out)
    assert torch.equal(out, x)


def test_arguments_are_checked(monkeypatch):
    with pytest.raises(ValueError, match=r"oneshot_ctas=0 .*in \[1, 1024\]"):
        BackendSettings(oneshot_ctas=0)
    with pytest.raises(ValueError, match="spin_timeout_ms"):
        BackendSettings(spin_timeout_ms=0)
    monkeypatch.setenv("RADIANCE_AR_ONESHOT_CTAS", "many")
    with pytest.raises(ValueError, match="RADIANCE_AR_ONESHOT_CTAS='many'"):
        OneshotWht6Backend(single_world())
    be = OneshotWht6Backend(single_world(), BackendSettings(oneshot_ctas=4))
    assert (be.ctas, be.timeout_ms) == (4, 1000.0)  # the settings', not the environment's
    with pytest.raises(ValueError, match="max_rows"):
        be.ensure_capacity(0, 256, DT)
    with pytest.raises(TypeError, match="dtype"):
        be.ensure_capacity(4, 256, torch.int32)
    with pytest.raises(ValueError, match="cols must be a positive multiple of 256.*got 96"):
        be.ensure_capacity(4, 96, DT)
    with pytest.raises(ValueError, match="cols must be a positive multiple of 256.*got 320"):
        be.all_reduce(torch.zeros(2, 320, dtype=DT), torch.zeros(2, 320, dtype=DT))
    with pytest.raises(ValueError, match="fill_passive_peers: call ensure_capacity"):
        be.fill_passive_peers()


def test_gate_refuses_what_it_cannot_serve():
    from radiance_ar.transport.peer_memory import LocalMemory

    big = World(0, 9, torch.device("cpu"), LocalMemory(torch.device("cpu")))
    assert "world size 9" in OneshotWht6Backend.unsupported_reason(big)
    with pytest.raises(ValueError, match="cannot run here"):
        OneshotWht6Backend(big)


INTERPRETER_SCRIPT = r"""
import torch
from radiance_ar.backends.kernels import oneshot_wht6 as K
from radiance_ar.wht6.wht6_decode_accumulate import wht6_decode_accumulate
from radiance_ar.wht6.wht6_encode import wht6_encode
torch.manual_seed(0)
G = 3  # CTAs: several tiles per CTA, and CTAs without tiles
for rows, cols, size, rank in ((5, 512, 1, 0), (9, 768, 2, 1), (4, 320, 3, 0)):
    wide = K.padded_cols(cols)
    xs = [torch.randn(rows, cols).to(torch.bfloat16) for _ in range(size)]
    pads = [torch.nn.functional.pad(x, (0, wide - cols)) for x in xs]
    nbytes = rows * K.payload_bytes_per_row(cols)
    region = nbytes + 8
    pubs = [torch.zeros(2 * region, dtype=torch.uint8) for _ in range(size)]
    SIG = 12345  # the call's signature hash, the same on every rank
    # per rank: G epoch flags, then G signature words per parity (0, 1)
    flags = [torch.zeros(3 * G, dtype=torch.int64) for _ in range(size)]
    for p in range(size):
        if p != rank:  # passive peers: payload of epoch 1 (region 1) and flags already up
            pubs[p][region:region + nbytes] = wht6_encode(pads[p]).view(-1)
            flags[p][:G] = 1
            flags[p][2 * G:] = SIG
    own, err = torch.zeros(region, dtype=torch.uint8), torch.zeros(5, dtype=torch.int64)
    out = torch.full((rows, cols), float("nan"))  # fp32: the interpreter truncates to bf16
    K.launch(xs[rank].float(), out, pubs, flags, own, err, rank, region, 50.0, G, sig=SIG)
    want = wht6_decode_accumulate([wht6_encode(p) for p in pads], (rows, wide), torch.float32)
    assert torch.equal(out, want[:, :cols]), (rows, cols, size)
    ref = sum(x.double() for x in xs)
    assert float((out.double() - ref).norm() / ref.norm()) < 2 ** -5
    assert flags[rank][:G].tolist() == [1] * G and err.tolist() == [0] * 5, (flags, err)
    assert flags[rank][2 * G:].tolist() == [SIG] * G  # this call's parity slot
    if size > 1:  # the next call: peers never post epoch 2, so every wait times out
        K.launch(xs[rank].float(), out, pubs, flags, own, err, rank, region, 0.05, G, sig=SIG)
        assert flags[rank][:G].tolist() == [2] * G and err[0] == 2 and err[2] == 1, err
        assert 0 <= err[1] - 1 < size and err[1] - 1 != rank, err  # names a peer
        # call 3: the peers' flags are up but their signature (parity 1) is another call's
        err.zero_()
        for p in range(size):
            if p != rank:
                flags[p][:G] = 3
        K.launch(xs[rank].float(), out, pubs, flags, own, err, rank, region, 50.0, G, sig=SIG + 1)
        assert err[0] == 3 and err[2] == 2 and err[1] - 1 != rank, err
        assert err[3] == 3 and err[4] == SIG, err  # what the waiter read: flag, slot
    K.launch(xs[rank].float(), out, pubs, flags, own, err, rank, region, 50.0, G, warm_up=True)
    assert flags[rank][:G].tolist() == [1 + 2 * (size > 1)] * G  # a warm-up touches nothing
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fused_kernel_under_the_interpreter():
    run_under_interpreter(INTERPRETER_SCRIPT)


# ------------------------------------------------------------------ one GPU, W emulated ranks

DEV = torch.device("cuda", 0)


def _emulated(size, **settings):
    ranks = EmulatedRanks(size, DEV)
    bes = [OneshotWht6Backend(w, BackendSettings(**settings)) for w in ranks.worlds]
    return bes, ranks


def _run_all(bes, ranks, xs, outs, bounds):
    def step(r):  # on rank r's stream, after the inputs and poisoned outputs are ready
        for a, b in zip(bounds[:-1], bounds[1:]):
            bes[r].all_reduce(xs[r][a:b], outs[r][a:b])

    ranks.each(step)
    for be in bes:
        be.check(10_000)
    torch.cuda.synchronize(DEV)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4])
def test_emulated_ranks_accurate_identical_exact_and_no_stale_flags(size):
    bes, ranks = _emulated(size)
    plan = random.Random(size)
    shapes = [(1, 256), (300, 5120), (64, 768), (3, 256)]
    shapes += [(plan.randint(1, 200), plan.choice([256, 1280, 5120])) for _ in range(40)]
    for call, (rows, cols) in enumerate(shapes):
        xs = [jobs.make_input(7, call, r, rows, cols).to(DEV) for r in range(size)]
        outs = [torch.full((rows, cols), float("nan"), dtype=DT, device=DEV) for _ in bes]
        for be in bes:
            be.ensure_capacity(rows, cols, DT)
        before = [be.pulled_bytes for be in bes]
        bounds = slice_bounds(rows, plan.randint(1, 4))
        _run_all(bes, ranks, xs, outs, bounds)
        ref = jobs.reference(7, call, size, rows, cols)
        for r, out in enumerate(outs):
            assert not torch.isnan(out).any(), (call, rows, cols, r)
            assert world_jobs.rel_rms(out, ref) < BOUND, (call, rows, cols, r)
            assert torch.equal(jobs.bits(out), jobs.bits(outs[0])), (call, rows, cols, r)
        # The fused kernel computes what the codec's own kernels compute, bit for bit.
        want = torch.cat([jobs.codec_result([x[a:b] for x in xs])
                          for a, b in zip(bounds[:-1], bounds[1:])])
        assert torch.equal(jobs.bits(outs[0].cpu()), jobs.bits(want.cpu())), (call, rows, cols)
        moved = (size - 1) * sum(jobs.payload_bytes(b - a, cols)
                                 for a, b in zip(bounds[:-1], bounds[1:]))
        assert [be.pulled_bytes - b0 for be, b0 in zip(bes, before)] == [moved] * size


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4])
def test_cuda_graph_replays_stay_correct(size):
    rows, cols = 96, 1280
    bes, ranks = _emulated(size)
    streams = ranks.streams
    xs = [torch.zeros(rows, cols, dtype=DT, device=DEV) for _ in bes]
    outs = [torch.zeros(rows, cols, dtype=DT, device=DEV) for _ in bes]
    for be in bes:
        be.ensure_capacity(rows, cols, DT)
    _run_all(bes, ranks, xs, outs, [0, rows])  # a call before capture: epochs already > 0
    graphs = [torch.cuda.CUDAGraph() for _ in bes]
    for be, g, s, x, out in zip(bes, graphs, streams, xs, outs):
        with torch.cuda.graph(g, stream=s):  # one graph per rank, each replayed on its stream
            be.all_reduce(x[:rows // 2], out[:rows // 2])
            be.all_reduce(x[rows // 2:], out[rows // 2:])
    torch.cuda.synchronize(DEV)
    for call in range(100):
        for r, (g, s) in enumerate(zip(graphs, streams)):
            with torch.cuda.stream(s):
                xs[r].copy_(jobs.make_input(9, call, r, rows, cols).to(DEV, non_blocking=True))
                outs[r].fill_(float("nan"))
                g.replay()
        torch.cuda.synchronize(DEV)  # a replay records no event: check() reads its error words
        for be in bes:
            be.check(10_000)
        ref = jobs.reference(9, call, size, rows, cols)
        for r, out in enumerate(outs):
            assert world_jobs.rel_rms(out, ref) < BOUND, (call, r)
            assert torch.equal(jobs.bits(out), jobs.bits(outs[0])), (call, r)


@pytest.mark.gpu
def test_missing_peer_raises_within_the_bound_and_the_gpu_keeps_working():
    bes, ranks = _emulated(2, spin_timeout_ms=300)
    for be in bes:
        be.ensure_capacity(8, 512, DT)
    x = torch.randn(8, 512, device=DEV).to(DT)
    out = torch.empty_like(x)
    start = time.monotonic()
    with ranks.on(0):
        bes[0].all_reduce(x, out)  # rank 1 never calls
    with pytest.raises(PeerTimeoutError, match=r"peer rank 1 did not post .*epoch\) 1 .*resync"):
        bes[0].check()
    assert time.monotonic() - start < 1.5
    assert float(torch.ones(1000, device=DEV).sum()) == 1000.0  # the device runs work
    for be in bes:
        be.resync()
    outs = [torch.full_like(x, float("nan")) for _ in bes]
    xs = [jobs.make_input(3, 0, r, 8, 512).to(DEV) for r in range(2)]
    _run_all(bes, ranks, xs, outs, [0, 8])
    assert all(world_jobs.rel_rms(o, jobs.reference(3, 0, 2, 8, 512)) < BOUND for o in outs)


@pytest.mark.gpu
def test_emulated_ranks_through_the_op():
    size, rows, cols, k, seed = 2, 257, 1280, 512, 3
    ref = world_jobs.reference(seed, size, rows, cols, k)
    ranks = EmulatedRanks(size, DEV)
    shards = world_jobs.device_shards(seed, size, rows, cols, k, DEV)
    for s in (1, 2, 4):
        rts = [overlap.build(wd, OverlapSettings(True, "oneshot_wht6", 1, s)) for wd in ranks.worlds]
        outs = world_jobs.emulated_forward(ranks, rts, shards, 10_000)
        for r, out in enumerate(outs):
            assert world_jobs.rel_rms(out, ref) < BOUND, (s, r)
            assert torch.equal(jobs.bits(out.cpu()), jobs.bits(outs[0].cpu())), (s, r)
        for rt in rts:
            rt.close()
