"""radiance_ar.overlap.plan: the one call plan the op, the timeline and the tools share.

The plan's bounds are the op's (slicing.op_bounds at the producer's alignment) for
several settings and backends, and the tools cut with them; in a CPU world of two
processes its hooks fire once per slice, in order, around the op's real GEMM and AR
calls, and the op's output equals the pre-plan body's (rebuilt here) bit for bit.
"""

from types import SimpleNamespace

import pytest
import torch

from radiance_ar import backends, overlap
import prefill_emulated
import prefill_measure
import world_jobs
import world_measure
from radiance_ar.overlap import producers
from radiance_ar.envs import BackendSettings
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.pipeline import run_sliced
from radiance_ar.overlap.plan import CallPlan, SliceHooks, input_view, row_bounds
from radiance_ar.overlap.producers import TorchMM
from radiance_ar.overlap.slicing import op_bounds
from radiance_ar.transport.world import World, single_world


def backend_with(preferred: int) -> world_jobs.PeerSumBackend:
    class Preferring(world_jobs.PeerSumBackend):
        preferred_slices = preferred

    return Preferring(single_world("cpu"))


@pytest.mark.parametrize("producer", ["bf16", "fp8_rowwise"])  # row alignment 1 and 16
@pytest.mark.parametrize("setting,preferred,plan", [
    (4, 4, "uniform"), ("auto", 3, "uniform"), ("auto", 1, "uniform"), (7, 2, "uniform"),
    (3, 4, "growing"), ("auto", 2, "growing"), (5, 1, "growing")])
@pytest.mark.parametrize("rows", [8, 40, 100, 1000])
def test_the_plans_bounds_are_the_ops_and_it_sets_the_call_key(producer, setting, preferred,
                                                               plan, rows):
    backend = backend_with(preferred)
    rt = overlap.OverlapRuntime(backend.world,
                                OverlapSettings(True, backend.name, 8, setting, plan=plan),
                                backend)
    prod = producers.get(producer)
    x, w = torch.zeros(rows, 32, dtype=torch.bfloat16), torch.zeros(24, 32, dtype=torch.bfloat16)
    layer = rt.register_layer(w)
    call = CallPlan.for_call(rt, prod, x, w)
    expected = op_bounds(rt.settings, backend, rows, prod.slice_row_align)
    assert call.sliced and list(call.bounds) == expected
    assert row_bounds(prod, rows, setting, plan, backend) == expected
    assert call.slices == len(expected) - 1
    assert (call.rows, call.cols, call.k, call.layer) == (rows, 24, 32, layer)
    assert backend._call_key == (rows, 32, layer)


@pytest.mark.parametrize("name", backends.names())
def test_registered_backends_plan_their_settings_bounds(name):
    world = single_world("cpu")
    if backends.get(name).unsupported_reason(world) is not None:
        pytest.skip(f"{name} does not serve a one-rank CPU world")
    rt = overlap.build(world, OverlapSettings(True, name, 8, "auto", plan="growing"))
    try:
        prod = producers.get("bf16")
        for rows in (3, 8, 97):
            x, w = torch.zeros(rows, 16, dtype=torch.bfloat16), torch.zeros(256, 16, dtype=torch.bfloat16)
            call = CallPlan.for_call(rt, prod, x, w)
            if rows < 8 or not rt.backend.pipelined:  # the decode path: one GEMM, one AR
                assert not call.sliced and call.bounds == (0, rows)
            else:
                assert call.sliced
                assert list(call.bounds) == op_bounds(rt.settings, rt.backend, rows, 1)
    finally:
        rt.close()


def test_below_min_m_the_plan_is_unsliced_and_leaves_the_call_key():
    backend = backend_with(4)
    rt = overlap.OverlapRuntime(backend.world, OverlapSettings(True, backend.name, 8, 4), backend)
    x, w = torch.zeros(5, 32, dtype=torch.bfloat16), torch.zeros(24, 32, dtype=torch.bfloat16)
    call = CallPlan.for_call(rt, producers.get("bf16"), x, w)
    assert (call.sliced, call.bounds, call.layer) == (False, (0, 5), 0)
    assert backend._call_key == (0, 0, 0)


def test_input_view_is_the_peer_visible_view_else_the_fallback():
    peer = backend_with(4)
    view = input_view(peer, 6, 8, torch.bfloat16, lambda: pytest.fail("peer-visible: no fallback"))
    assert view.shape == (6, 8) and view.data_ptr() == peer.buffer.local.data_ptr()
    stock = backends.get("stock")(single_world("cpu"))
    own = torch.zeros(6, 8, dtype=torch.bfloat16)
    assert input_view(stock, 6, 8, torch.bfloat16, lambda: own) is own
    with pytest.raises(TypeError, match="no peer-visible input buffer"):
        input_view(stock, 6, 8, torch.bfloat16)


def test_the_tools_cut_slices_with_the_ops_bounds():
    for producer in ("bf16", "fp8_rowwise"):
        prod = producers.get(producer)
        for plan in ("uniform", "growing"):
            case = world_measure.Case("sdma", 1000, 64, 32, 3, 1, 0, producer=producer, plan=plan)
            settings = OverlapSettings(True, "sdma", 1, 3, plan=plan)
            assert world_measure.slice_plan(case, 3) == op_bounds(
                settings, None, 1000, prod.slice_row_align)
        spec = SimpleNamespace(backends=("sdma", "sdma_wht6"), slices=3, chunk_rows=(100, 37),
                               knobs=BackendSettings(), shapes=SimpleNamespace(tp=2))
        sizes = prefill_emulated.op_slice_rows(spec, SimpleNamespace(producer=prod))
        expected = set()
        for name in spec.backends:
            settings = prefill_measure.settings(spec, name, 3)
            for rows in spec.chunk_rows:
                b = op_bounds(settings, backends.get(name), rows, prod.slice_row_align)
                expected.update(q - p for p, q in zip(b[:-1], b[1:]))
        assert sizes == expected
        # 100 and 37 rows in 3 slices: 33 + 33 + 34 and 12 + 12 + 13, or at fp8's
        # 16-row alignment 32 + 32 + 36 and 16 + 16 + 5
        assert sizes == ({33, 34, 12, 13} if producer == "bf16" else {32, 36, 16, 5})


# ----------------------------------------------------------------------- CPU world


def _old_body(rt, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op's sliced path as written before the plan (op.py's ``body``)."""
    prod, backend = producers.get("bf16"), rt.backend
    rows, cols = x.shape[0], w.shape[0]
    backend.set_call_key(rows, x.shape[1], rt.layer_number(w))
    bounds = op_bounds(rt.settings, backend, rows, prod.slice_row_align)
    out = torch.empty((rows, cols), dtype=x.dtype)
    prepared = prod.prepare(x, w, None, rt.scratch)
    backend.ensure_capacity(rows, cols, out.dtype)
    y = (backend.acquire_input_view(rows, cols, out.dtype) if backend.peer_visible_input
         else rt.scratch.get("gemm_out", (rows, cols), out.dtype, x.device))
    run_sliced(prepared, prod, backend, y, out, bounds, rt.lanes())
    return out


def hooks_job(world: World, backend: str, rows: int, cols: int, k: int, slices, plan: str,
              min_m: int, seed: int) -> dict:
    """The op, the pre-plan body and a planned call with hooks, on this rank."""
    if backends.get(backend).unsupported_reason(world) is not None:
        return {"skipped": backends.get(backend).unsupported_reason(world)}
    rt = overlap.build(world, OverlapSettings(True, backend, min_m, slices, plan=plan))
    log: list[tuple] = []

    class Logged(TorchMM):
        def launch(self, p, a, b, out, stream):
            log.append(("gemm", a, b))
            super().launch(p, a, b, out, stream)

    def logged(be):
        inner = be.all_reduce
        be.all_reduce = lambda slice_in, out: (log.append(("ar", slice_in.shape[0])),
                                               inner(slice_in, out))[1]

    try:
        x, w = world_jobs.shard(seed, world.rank, rows, cols, k)
        op_out = overlap.forward(rt, x, w, None, "bf16")
        old = _old_body(rt, x, w) if rows >= min_m and rt.backend.pipelined else None
        logged(rt.backend)
        if rt.stock is not rt.backend:
            logged(rt.stock)
        call = CallPlan.for_call(rt, Logged(), x, w)
        hooks = SliceHooks(*(lambda s, tag=tag: log.append((tag, s))
                             for tag in ("gemm_before", "gemm_after", "ar_before", "ar_after")))
        out = torch.full((rows, cols), float("nan"), dtype=x.dtype)
        with rt.one_call_at_a_time():
            call.run(rt, Logged(), x, w, None, out, hooks)
        return {"op": op_out, "old": old, "hooked": out, "log": log, "bounds": call.bounds,
                "sliced": call.sliced, "bound": rt.backend.rel_rms_bound,
                "ref": world_jobs.reference(seed, world.size, rows, cols, k)}
    finally:
        rt.close()


def expected_log(bounds: tuple[int, ...]) -> list[tuple]:
    """Every GEMM slice between its hooks, then every AR slice between its hooks."""
    spans = list(zip(bounds[:-1], bounds[1:]))
    return ([e for s, (a, b) in enumerate(spans)
             for e in (("gemm_before", s), ("gemm", a, b), ("gemm_after", s))]
            + [e for s, (a, b) in enumerate(spans)
               for e in (("ar_before", s), ("ar", b - a), ("ar_after", s))])


@pytest.mark.parametrize("backend,slices,plan,rows,min_m", [
    ("sdma", 4, "uniform", 40, 1), ("sdma", 3, "growing", 37, 1), ("sdma", "auto", "uniform", 40, 1),
    ("sdma_wht6", 3, "uniform", 40, 1), ("oneshot_wht6", 2, "growing", 40, 1),
    ("stock", 4, "uniform", 40, 1),  # stock is not pipelined: GEMM, then the vendor AR
    ("sdma", 4, "uniform", 5, 8),  # below MIN_M: the decode path
])
def test_hooks_fire_once_per_slice_around_the_ops_calls_and_the_output_is_unchanged(
        cpu_world, backend, slices, plan, rows, min_m):
    res = world_jobs.run_where_served(cpu_world(2), hooks_job, backend, rows, 256, 32, slices,
                                      plan, min_m, 11)
    for r in res:
        assert r["log"] == expected_log(r["bounds"])
        assert r["sliced"] == (backend != "stock" and rows >= min_m)
        if r["sliced"]:
            assert torch.equal(r["op"], r["old"])  # the op's output, bit for bit
        assert torch.equal(r["hooked"], r["op"])  # the hooks change nothing it computes
        assert torch.equal(r["op"], res[0]["op"])
        err = (r["op"].double() - r["ref"]).pow(2).mean().sqrt() / r["ref"].pow(2).mean().sqrt()
        assert err <= r["bound"]
