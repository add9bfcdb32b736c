"""Producers in a one-rank world: the generic quant-method producer against the layer's
unsliced apply (bit for bit), the fp8 producers under slicing, bound producer names,
and flat buffers over random M. GPU tests (marked) repeat the exactness and the memory
check with the side stream."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from markers import FP8_ON_CPU

from radiance_ar import overlap
import world_jobs
from radiance_ar.transport.world import single_world
from radiance_ar.overlap import producers
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.producer_quant import PREFIX, bind_layer, shape_carrier

FP8 = torch.float8_e4m3fn
N, K = 48, 64


def runtime(min_m: int, slices: int, device: str = "cpu") -> overlap.OverlapRuntime:
    world = single_world(device)
    backend = world_jobs.PeerSumBackend(world)  # one rank: an fp32 copy, exact for bf16
    return overlap.OverlapRuntime(world, OverlapSettings(True, backend.name, min_m, slices),
                                  backend)


# ---------------------------------------------------------------- test linear methods

class Int8WeightOnly:
    """int8 weights, one float32 scale per output channel; apply dequantizes then GEMMs."""

    def create(self, layer, w):
        scale = w.abs().amax(dim=1) / 127
        layer.qweight = torch.nn.Parameter((w / scale[:, None]).round().to(torch.int8),
                                           requires_grad=False)
        layer.scales = torch.nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x, bias=None):
        w = layer.qweight.to(x.dtype) * layer.scales.to(x.dtype)[:, None]
        return F.linear(x, w, bias)


class Fp8PerToken:
    """fp8 weights with per-channel scales; per-token dynamic fp8 activation scales."""

    def create(self, layer, w):
        scale = w.abs().amax(dim=1) / 448
        layer.weight8 = torch.nn.Parameter((w / scale[:, None]).to(FP8), requires_grad=False)
        layer.w_scale = torch.nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x, bias=None):
        x_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448).clamp_min(1e-12)
        x8 = (x.float() / x_scale).to(FP8)
        return torch._scaled_mm(x8, layer.weight8.t(), scale_a=x_scale,
                                scale_b=layer.w_scale.view(1, -1), out_dtype=x.dtype)


class Fp8PerTensorDynamic:
    """vLLM's per-tensor dynamic scheme: ONE activation scale over the input it is given."""

    def create(self, layer, w):
        scale = w.abs().amax() / 448
        layer.weight8 = torch.nn.Parameter((w / scale).to(FP8), requires_grad=False)
        layer.w_scale = torch.nn.Parameter(scale.reshape(()), requires_grad=False)

    def apply(self, layer, x, bias=None):
        x_scale = (x.abs().amax().float() / 448).clamp_min(1e-12).reshape(1)
        return torch._scaled_mm((x.float() / x_scale).to(FP8), layer.weight8.t(),
                                scale_a=x_scale, scale_b=layer.w_scale.reshape(1),
                                out_dtype=x.dtype)


class QuantLayer(torch.nn.Module):
    def __init__(self, method, n=N, k=K, seed=0, device="cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.quant_method = method
        self.output_size_per_partition, self.input_size_per_partition = n, k
        method.create(self, (torch.randn(n, k, generator=g) / k ** 0.5).to(device))


def activations(rows, k=K, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).bfloat16().to(device)


METHODS = [Int8WeightOnly, pytest.param(Fp8PerToken, marks=FP8_ON_CPU)]


# ---------------------------------------------------------------- the generic producer

@pytest.mark.parametrize("method", METHODS)
def test_generic_producer_equals_the_unsliced_apply_bit_for_bit(method):
    layer = QuantLayer(method())
    name = bind_layer(f"test.exact.{method.__name__}", layer, N, K)
    carrier = shape_carrier(N, K, torch.device("cpu"))
    for rows in (1, 37, 256):
        x = activations(rows)
        ref = layer.quant_method.apply(layer, x)
        for min_m, slices in ((1, 1), (1, 3), (1, 7), (1024, 4)):  # sliced, and decode
            out = overlap.forward(runtime(min_m, slices), x, carrier, None, name)
            assert torch.equal(out, ref), (rows, min_m, slices)


@FP8_ON_CPU
def test_per_tensor_dynamic_scales_drift_when_sliced_and_fp8_tensorwise_does_not():
    # Why vLLM's per-tensor dynamic fp8 is routed to fp8_tensorwise and never to the
    # generic producer: sliced, the layer's own apply gives each slice its own scale.
    layer = QuantLayer(Fp8PerTensorDynamic())
    name = bind_layer("test.drift.per_tensor", layer, N, K)
    carrier = shape_carrier(N, K, torch.device("cpu"))
    x = activations(256)
    x[3] *= 30  # one loud token sets the whole input's scale, not its slice-mates'
    ref = layer.quant_method.apply(layer, x)
    generic = overlap.forward(runtime(1, 4), x, carrier, None, name)
    assert not torch.equal(generic, ref)
    w8, w_scale = layer.weight8, layer.w_scale
    whole = overlap.forward(runtime(1, 1), x, w8, w_scale, "fp8_tensorwise")
    for slices in (2, 4, 7):
        assert torch.equal(overlap.forward(runtime(1, slices), x, w8, w_scale,
                                           "fp8_tensorwise"), whole), slices
    # Against the quantized operands in float64: one scale over all rows.
    x_scale = x.abs().amax().double() / 448
    x8 = (x.float() / x_scale.float()).to(FP8)
    exact = (x8.double() * x_scale) @ (w8.double() * w_scale.double()).t()
    assert (whole.double() - exact).abs().max() <= 2 ** -7 * exact.abs().max()
    assert torch.equal(whole, ref)  # the same arithmetic as the unsliced layer here


@FP8_ON_CPU
def test_fp8_rowwise_takes_one_per_tensor_weight_scale_as_n_equal_channel_scales():
    x, w = world_jobs.shard(0, 0, 40, N, K)
    w_scale = w.float().abs().amax() / 448
    w8 = (w.float() / w_scale).to(FP8)
    rt = runtime(1, 3)
    per_tensor = overlap.forward(rt, x, w8, w_scale.reshape(()), "fp8_rowwise")
    assert torch.equal(overlap.forward(rt, x, w8, w_scale.reshape(1), "fp8_rowwise"), per_tensor)
    assert torch.equal(overlap.forward(rt, x, w8, w_scale.expand(N).contiguous(),
                                       "fp8_rowwise"), per_tensor)
    with pytest.raises(ValueError, match=r"shape \(48,\).*got torch.float32 \(2,\)"):
        overlap.forward(rt, x, w8, w_scale.expand(2).contiguous(), "fp8_rowwise")
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        overlap.forward(rt, x, w8.t().contiguous().t(), w_scale, "fp8_rowwise")
    with pytest.raises(ValueError, match="ONE float32 per-tensor scale"):
        overlap.forward(rt, x, w8, w_scale.expand(N).contiguous(), "fp8_tensorwise")


def test_buffers_stay_flat_over_300_calls_of_random_m_through_the_generic_producer():
    world = single_world("cpu")
    backend = world_jobs.PeerSumBackend(world)
    rt = overlap.OverlapRuntime(world, OverlapSettings(True, backend.name, 512, 4), backend)
    layer = QuantLayer(Int8WeightOnly(), n=8, k=16)
    name = bind_layer("test.memory.int8", layer, 8, 16)
    carrier = shape_carrier(8, 16, torch.device("cpu"))
    x = activations(4096, k=16)
    overlap.forward(rt, x, carrier, None, name)  # warm-up at the high-water mark
    growths, reserved = rt.scratch.growths, rt.scratch.reserved_bytes()
    peer = (world.memory.allocations, world.memory.allocated_bytes)
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        rows = int(torch.randint(1, 4097, (1,), generator=gen))
        assert overlap.forward(rt, x[:rows], carrier, None, name).shape == (rows, 8)
    assert (rt.scratch.growths, rt.scratch.reserved_bytes()) == (growths, reserved)
    assert (world.memory.allocations, world.memory.allocated_bytes) == peer


# ---------------------------------------------------------------- bound names and checks

def test_bound_names_are_stable_unique_per_live_layer_and_outside_the_kernel_list():
    first, second = QuantLayer(Int8WeightOnly()), QuantLayer(Int8WeightOnly(), seed=1)
    name = bind_layer("model.layers.0.mlp.down_proj", first, N, K)
    assert name == PREFIX + "model.layers.0.mlp.down_proj"
    assert bind_layer("model.layers.0.mlp.down_proj", first, N, K) == name  # idempotent
    # A second live model's layer of the same name: its own, deterministic suffix.
    assert bind_layer("model.layers.0.mlp.down_proj", second, N, K) == name + "#2"
    assert name not in producers.names() and "bf16" in producers.names()
    assert producers.get(name).layer() is first
    # The first model is unloaded: its name is free for the next model's layer.
    del first
    gc.collect()
    carrier = shape_carrier(N, K, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="garbage-collected"):
        overlap.forward(runtime(1, 2), activations(4), carrier, None, name)
    third = QuantLayer(Int8WeightOnly(), seed=2)
    assert bind_layer("model.layers.0.mlp.down_proj", third, N, K) == name
    assert producers.get(name).layer() is third
    with pytest.raises(ValueError, match="key must be a non-empty string"):
        bind_layer("", third, N, K)
    with pytest.raises(ValueError, match="'bf16' is a registered kernel"):
        producers.bind(type(producers.get(name))("bf16", third, N, K))
    with pytest.raises(ValueError, match="already registered"):
        producers.register_external(name, lambda *a: None)
    with pytest.raises(ValueError, match=r"unknown producer 'nope'.*bound to layers"):
        producers.get("nope")


class WrongDtype(Int8WeightOnly):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x).float()


class WrongShape(Int8WeightOnly):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x)[:, :-1]


@pytest.mark.parametrize("method,error,match", [
    (WrongDtype, TypeError, r"WrongDtype.apply returned torch.float32; the op returns "
                            r"the activation's dtype torch.bfloat16"),
    (WrongShape, ValueError, r"WrongShape.apply returned shape \(5, 47\) for 5 rows"),
])
def test_an_apply_that_is_not_x_at_w_t_in_the_activation_dtype_raises(method, error, match):
    layer = QuantLayer(method())
    name = bind_layer(f"test.wrong.{method.__name__}", layer, N, K)
    with pytest.raises(error, match=match):
        overlap.forward(runtime(1, 2), activations(10), shape_carrier(N, K, torch.device("cpu")),
                        None, name)


def test_the_generic_producer_checks_its_carrier_and_scale():
    layer = QuantLayer(Int8WeightOnly())
    name = bind_layer("test.checks", layer, N, K)
    rt, x = runtime(1, 2), activations(10)
    with pytest.raises(ValueError, match=r"\(N, K\) = \(48, 64\) shape carrier, got shape \(47, 64\)"):
        overlap.forward(rt, x, shape_carrier(N - 1, K, torch.device("cpu")), None, name)
    with pytest.raises(ValueError, match="weight_scale must be None"):
        overlap.forward(rt, x, shape_carrier(N, K, torch.device("cpu")), torch.ones(N), name)


def test_opcheck_and_one_compiled_node_with_a_shape_carrier():
    overlap.configure(single_world("cpu"), OverlapSettings(True, "stock", 8, 4))
    layer = QuantLayer(Int8WeightOnly())
    name = bind_layer("test.compile", layer, N, K)
    carrier = shape_carrier(N, K, torch.device("cpu"))
    for rows in (3, 16):
        torch.library.opcheck(torch.ops.radiance.linear_ar.default,
                              (activations(rows), carrier, None, name))

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.carrier = carrier

        def forward(self, x):
            return torch.ops.radiance.linear_ar(x * 2, self.carrier, None, name) + 1

    mod, graphs = Routed(), []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(mod, fullgraph=True, backend=record)(activations(16))
    calls = [n for g in graphs for n in g.graph.nodes
             if n.op == "call_function" and "linear_ar" in str(n.target)]
    assert len(graphs) == 1 and len(calls) == 1
    torch._dynamo.reset()
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    for rows in (16, 5, 40):
        x = activations(rows)
        assert torch.equal(compiled(x), layer.quant_method.apply(layer, x * 2) + 1)


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("method", [Int8WeightOnly, Fp8PerToken])
def test_gpu_generic_producer_on_the_side_stream_equals_the_unsliced_apply(method):
    layer = QuantLayer(method(), n=256, k=512, device="cuda")
    name = bind_layer(f"test.gpu.{method.__name__}", layer, 256, 512)
    carrier = shape_carrier(256, 512, torch.device("cuda"))
    x = activations(1000, k=512, device="cuda")
    ref = layer.quant_method.apply(layer, x)
    for slices in (1, 2, 3, 7):
        out = overlap.forward(runtime(1, slices, "cuda:0"), x, carrier, None, name)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), slices


@pytest.mark.gpu
def test_gpu_fp8_rowwise_quantizes_x_with_the_definitions_bits():
    """The producer quantizes x through the one-pass kernel: the bits of the torch
    definition (fp8_activation.quantize_activation), scales included."""
    from radiance_ar.overlap.fp8_activation import quantize_activation
    from radiance_ar.overlap.scratch import ScratchPool

    x, w = (t.cuda() for t in world_jobs.shard(0, 0, 1000, 256, 512))
    x[3] *= 1e-30  # tiny rows: scales near the floor
    w8 = (w.float() / (w.float().abs().amax() / 448)).to(FP8)
    prepared = producers.get("fp8_rowwise").prepare(x, w8, torch.ones(256, device="cuda"),
                                                    ScratchPool())
    xq, x_scale = quantize_activation(x)
    assert torch.equal(prepared.x.view(torch.uint8), xq.view(torch.uint8))
    assert torch.equal(prepared.x_scale, x_scale[:, None])


@pytest.mark.gpu
@pytest.mark.parametrize("producer", ["fp8_rowwise", "fp8_tensorwise"])
def test_gpu_fp8_producers_sliced_equal_unsliced(producer):
    x, w = (t.cuda() for t in world_jobs.shard(0, 0, 1000, 256, 512))
    w_scale = w.float().abs().amax() / 448
    w8 = (w.float() / w_scale).to(FP8)
    whole = overlap.forward(runtime(1, 1, "cuda:0"), x, w8, w_scale, producer)
    for slices in (2, 3, 7):
        out = overlap.forward(runtime(1, slices, "cuda:0"), x, w8, w_scale, producer)
        torch.cuda.synchronize()
        assert torch.equal(out, whole), slices


@pytest.mark.gpu
def test_gpu_memory_flat_over_2000_calls_of_random_m_through_the_generic_producer():
    # The per-slice temporaries of apply live in the side stream's pool: after a warm-up
    # at the high-water mark they are reused, never grown (nothing marks them as used by
    # another stream).
    rt = runtime(min_m=2048, slices=4, device="cuda:0")
    layer = QuantLayer(Int8WeightOnly(), n=128, k=128, device="cuda")
    name = bind_layer("test.gpu.memory", layer, 128, 128)
    carrier = shape_carrier(128, 128, torch.device("cuda"))
    x = activations(16384, k=128, device="cuda")
    gen = torch.Generator().manual_seed(0)

    def calls(n):
        for _ in range(n):
            rows = int(torch.randint(1, 16385, (1,), generator=gen))
            overlap.forward(rt, x[:rows], carrier, None, name)
        torch.cuda.synchronize()

    overlap.forward(rt, x, carrier, None, name)
    calls(300)
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    calls(2000)
    assert torch.cuda.memory_reserved() == reserved
    assert torch.cuda.memory_allocated() == allocated
