"""The vLLM installer and plugin: selection on stand-ins always; against a real vLLM where installed.

Real-vLLM tests build RowParallelLinear layers in a vLLM TP world of 2 CPU processes
(gloo; vLLM's own CpuCommunicator does the stock all-reduce) and compare the routed
layers with the same layers before install and with a float64 reference. Without vLLM
they skip.
"""

from __future__ import annotations

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
from overlap import vllm_install as vi
from overlap import vllm_plugin as vp
from overlap.config import OverlapSettings

# Same bound as the other CPU-world tests: bf16 rounding of the result and of each rank's
# partial sum, well inside 2^-6 of the output's scale.
REL_TOL = 2.0 ** -6
ON = OverlapSettings(True, "stock", 2048, 4)
OFF = OverlapSettings(False, "stock", 2048, 4)


class UnquantizedLinearMethod:
    """Stand-in with the class name of vLLM's unquantized method (matched by name)."""


class Fp8LinearMethod:
    """Stand-in for a vLLM quant method radiance-ar has no producer for."""


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
    (lambda: StandIn(quant=Fp8LinearMethod()), 2,
     "quant method Fp8LinearMethod has no radiance-ar producer (known: UnquantizedLinearMethod)"),
    (lambda: StandIn(bias=True, quant=Fp8LinearMethod()), 2, vi.HAS_BIAS),
])
def test_eligibility_and_the_reason_for_each_ineligible_layer(make, tp, expected):
    layer = make()
    assert vi.eligibility(layer, tp) == expected
    assert vi.producer_for(layer.quant_method) == (
        None if isinstance(layer.quant_method, Fp8LinearMethod) else "bf16")


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
    m.fp8, m.gathered = StandIn(quant=Fp8LinearMethod()), StandIn(reduce_results=False)
    return m


def test_plan_takes_the_eligible_and_groups_the_rest_by_reason():
    m = _stand_in_model()
    report = vi.InstallReport(ON, tp_size=2)
    chosen = vi.plan(m.named_children(), 2, report)
    assert [(n, p) for n, _, p in chosen] == [("down", "bf16"), ("o_proj", "bf16")]
    assert report.left[vi.HAS_BIAS] == ["biased", "biased2"]
    assert report.left[vi.NO_REDUCE] == ["gathered"]
    assert len(report.left) == 3
    report.routed = [n for n, _, _ in chosen]
    text = report.summary()
    assert text.startswith("radiance-ar: routed 2 of 6 RowParallel linears through "
                           "radiance::linear_ar (backend stock, tp 2, slices 4, min_m 2048)")
    assert f"left stock: 2 ({vi.HAS_BIAS}), e.g. biased" in text
    assert "left stock: 1 (quant method Fp8LinearMethod" in text


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
    assert [(n, p) for n, _, p in chosen] == [("aligned", "bf16")]
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
ROUTED = ("down", "o_proj")
LEFT = ("biased", "gathered", "solo", "awq", "packed")


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
            res.update(routed=report.routed, left=report.left, summary=report.summary())
            res["again"] = vi.install(m, settings=settings).already
            res["outputs"] = {}
            for (name, rows), (x, stock, ref) in before.items():
                layer = getattr(m, name)
                got = layer(x)
                res["outputs"][name, rows] = dict(
                    stock=stock, got=_first(got), ref=ref, tuple=isinstance(got, tuple),
                    reduce_results=layer.reduce_results, own_forward="forward" in layer.__dict__)
            res["targets"] = {name: _traced_targets(getattr(m, name), before[name, 40][0])
                              for name in ("down", "biased")}
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
        assert by_layer["packed"].startswith("weight is not a plain 2-D (N, K)")
        assert sorted(by_layer) == sorted(LEFT)
        assert r["summary"].startswith("radiance-ar: routed 2 of 7 RowParallel linears")
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
        routed, stock = r["targets"]["down"], r["targets"]["biased"]
        assert routed.count("radiance.linear_ar") == 1, routed
        assert not any("allreduce" in t.replace("_", "") for t in routed), routed
        assert any("allreduce" in t.replace("_", "") for t in stock), stock
