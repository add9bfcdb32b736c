"""Quantized RowParallel linears without vLLM: which producer each fp8 scheme maps to
(and why the others stay stock), the routed layers against a float64 reference,
``register_producer``, and a layer routed through its own quant method as one
compiled node."""

from __future__ import annotations

import types

import pytest
import torch

from markers import FP8_ON_CPU

from radiance_ar import overlap
from radiance_ar.transport.world import single_world
from radiance_ar.overlap import vllm_install as vi
from radiance_ar.overlap import vllm_routes as vr
from radiance_ar.overlap.config import OverlapSettings
from vllm_stand_ins import StandIn

FP8 = torch.float8_e4m3fn
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
        if self.activation_quant_key.scale.static:
            x_scale = layer.input_scale.double()
        elif tuple(self.activation_quant_key.scale.group_shape) == PER_TOKEN:
            x_scale = x.abs().amax(dim=1, keepdim=True).double() / 448
        else:
            x_scale = x.abs().amax().double() / 448
        x8 = (x.double() / x_scale).to(FP8)
        return ((x8.double() * x_scale) @ w.t()).to(x.dtype)


class Fp8StandIn(StandIn):
    """A RowParallelLinear after vLLM's fp8 processing: weight (K, N), the transpose of a
    contiguous (N, K) fp8 tensor, one per-tensor float32 scale (shape ()), and a static
    activation scale (no test input reaches 8)."""

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
        self.input_scale = torch.nn.Parameter(torch.tensor(8.0 / 448), requires_grad=False)
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
    n = 32 if producer.startswith("fp8_") else 24  # _scaled_mm on GPUs: N a multiple of 16
    layer = Fp8StandIn(method, n=n, layout=layout)
    found = vi.route_for(layer)
    assert (found.producer, found.out_features) == (producer, n)
    assert found.why.startswith(why), found.why
    assert vi.eligibility(layer, 2) is None
    if producer.startswith("fp8_"):
        weight, scale = found.operands(layer)
        assert weight.shape == (32, 16) and weight.is_contiguous() and weight.dtype == FP8
        assert scale.shape == (1,) and scale.dtype == torch.float32


@pytest.mark.parametrize("method,layout,reason", [
    (Fp8LinearMethod(PER_TENSOR), "padded",
     "quant method Fp8LinearMethod has dynamic per-tensor activation scales and producer "
     "fp8_tensorwise: weight is (24, 32), not (N, K) with the layer's K = 16 (e.g. padded); "
     "its own apply cannot be sliced (each slice would get its own scale)"),
    (Fp8LinearMethod(PER_CHANNEL), "kn_view",
     "quant method Fp8LinearMethod has activation scales of group shape (-1, 1): not "
     "known to be row-independent"),
    (type("Fp8LinearMethod", (), {})(), "kn_view",  # without its activation_quant_key
     "quant method Fp8LinearMethod has no activation_quant_key.scale (static, group_shape)"),
])
def test_fp8_schemes_that_cannot_be_sliced_exactly_stay_stock_with_the_reason(
        method, layout, reason):
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


def test_an_fp8_layer_torch_scaled_mm_would_refuse_on_a_gpu_is_not_routed_to_it():
    """N = 24: torch's CUDA _scaled_mm wants N and K multiples of 16 (the CPU one takes
    it), so the fp8 producers refuse it on every device: a per-token layer takes its own
    apply (row-independent), a per-tensor dynamic one stays stock."""
    token = vi.route_for(Fp8StandIn(Fp8LinearMethod(PER_TOKEN), n=24))
    assert token.producer == vi.GENERIC and "multiples of 16" in token.why
    tensor = vi.route_for(Fp8StandIn(Fp8LinearMethod(PER_TENSOR), n=24))
    assert isinstance(tensor, str) and "multiples of 16" in tensor


def test_a_registered_own_apply_still_refuses_a_dynamic_per_tensor_scale(registry):
    """register_producer(Fp8LinearMethod, "quant_method") must not send a per-tensor
    dynamic layer through its own apply: each slice would get its own scale."""
    vi.register_producer(Fp8LinearMethod, vi.GENERIC)
    found = vi.route_for(Fp8StandIn(Fp8LinearMethod(PER_TENSOR), n=32))
    assert isinstance(found, str) and "dynamic per-tensor" in found
    static = vi.route_for(Fp8StandIn(Fp8LinearMethod(PER_TENSOR, static=True), n=32))
    assert static.producer == vi.GENERIC


def test_the_generic_producers_name_cannot_be_taken_by_a_kernel():
    from radiance_ar.overlap import producers

    for name in (vi.GENERIC, vi.GENERIC + ":layers.0"):
        with pytest.raises(ValueError, match="names the generic producer"):
            producers.register_external(name, lambda *a: None)
