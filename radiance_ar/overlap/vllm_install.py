"""Route vLLM's RowParallel linears through ``radiance::linear_ar`` (docs/design.md, 'Layout').

:func:`install` walks a loaded vLLM model and, for every eligible ``RowParallelLinear``,
replaces the layer's forward with one call of the op and sets ``reduce_results`` False:
the op owns the all-reduce on both of its paths (sliced at M >= MIN_M, stock below),
so the layer must not reduce a second time. Every other layer is left exactly as vLLM
built it, and the report says why. :func:`eligibility` decides, from duck-typed
attributes and the configured backend's pure gate on N only, so the selection is
testable without vLLM. Which producer computes a layer's GEMM (a kernel, or the
layer's own quantized linear method per slice) is :mod:`radiance_ar.overlap.vllm_routes`'s
mapping; :func:`register_producer` adds a linear method to it.

Enabling the op changes the graph torch.compile traces (vLLM's all-reduce node becomes
our op), so vLLM's compile cache must be keyed on the flag: see
:mod:`radiance_ar.overlap.vllm_plugin`, which adds it to the factors vLLM hashes.

vLLM is imported lazily: this module imports without it.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from radiance_ar import backends
from radiance_ar.envs import AUTO_BACKEND, MAX_OP_GRAPHS, OVERLAP_PLANS
import radiance_ar.overlap.op  # noqa: F401 -- registers torch.ops.radiance.linear_ar
from radiance_ar.backends.interface import Backend
from radiance_ar.overlap.config import OverlapSettings, from_env
from radiance_ar.overlap.producer_quant import GENERIC, bind_layer, shape_carrier
from radiance_ar.overlap.slicing import auto_slices_text
from radiance_ar.overlap.vllm_routes import (CARRIER_ATTR, Operands, Route, device_of,
    plain_weight, register_producer, route_for)

__all__ = ["GENERIC", "InstallReport", "eligibility", "install", "plan", "register_producer",
           "route", "route_for"]

#: a child of vLLM's logger: inside vLLM its lines carry vLLM's format and level
#: (VLLM_LOGGING_LEVEL); without vLLM it is an ordinary logger
logger = logging.getLogger("vllm.radiance_ar")

#: set on a routed layer: the producer its forward passes to the op
ROUTED_ATTR = "radiance_ar_producer"
#: set on a routed layer: (layer) -> the op's (weight, weight_scale), read at each call
OPERANDS_ATTR = "radiance_ar_operands"
#: what eligibility reads; a layer without one of these is not a RowParallelLinear
#: (a quantized layer has no ``weight``: its quant method keeps qweight, scales, ...)
REQUIRED_ATTRS = ("bias", "reduce_results", "quant_method", "return_bias")

ALREADY_ROUTED = "already routed through radiance::linear_ar"
TP_ONE = "tensor-parallel size 1: no all-reduce to hide"
OTHER_GROUP = ("its tp_size differs from the tensor-parallel group's: it reduces over another "
               "group (a subclass of its own), which the op does not serve")
HAS_BIAS = "has a bias: bias after the reduction stays vLLM's own contract"
NO_REDUCE = "reduce_results is False: the model reduces this output elsewhere"
SPLITS_INPUT = "input_is_parallel is False: the layer splits its own input"
LORA = ("LoRA is enabled: vLLM's LoRA wrappers run the base layer's GEMM and "
        "all-reduce themselves, bypassing its forward")


def eligibility(layer: Any, tp_size: int, backend: type[Backend] | None = None) -> str | None:
    """None if ``layer`` (a RowParallelLinear) can be routed at TP size ``tp_size``, else why not.

    Reads only attributes (see ``REQUIRED_ATTRS``; ``tp_size``, ``input_is_parallel`` and
    what :func:`radiance_ar.overlap.vllm_routes.route_for` reads are optional), so stand-in objects
    work as well as vLLM's own layers. ``backend`` (a backend class, e.g.
    ``backends.get(settings.backend)``) is asked whether it can reduce the layer's N
    output columns; None skips that question.
    """
    return _decide(layer, tp_size, backend)[0]


def _decide(layer: Any, tp_size: int, backend: type[Backend] | None
            ) -> tuple[str | None, Route | None]:
    """(None, the layer's route) or (why it stays stock, None)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"eligibility: tp_size must be an integer >= 1, got {tp_size!r}")
    if backend is not None and not (isinstance(backend, type) and issubclass(backend, Backend)):
        raise TypeError(f"eligibility: backend must be a Backend class (backends.get(name)), "
                        f"got {backend!r}")
    missing = [a for a in REQUIRED_ATTRS if not hasattr(layer, a)]
    if missing:
        raise TypeError(f"eligibility: {type(layer).__name__} has no attribute(s) "
                        f"{', '.join(missing)}; expected a vLLM RowParallelLinear")
    if hasattr(layer, ROUTED_ATTR):
        return ALREADY_ROUTED, None
    # A layer built with disable_tp has its own tp_size of 1 inside a TP > 1 model.
    if tp_size == 1 or getattr(layer, "tp_size", tp_size) == 1:
        return TP_ONE, None
    if getattr(layer, "tp_size", tp_size) != tp_size:
        return OTHER_GROUP, None
    if layer.bias is not None:
        return HAS_BIAS, None
    if not layer.reduce_results:
        return NO_REDUCE, None
    if not getattr(layer, "input_is_parallel", True):
        return SPLITS_INPUT, None
    found = route_for(layer)
    if isinstance(found, str):
        return found, None
    # The op all-reduces (rows, N) slices of the output; a backend that cannot reduce rows
    # of N values (a codec's block size) would raise at the layer's first prefill, so the
    # layer stays stock and the summary says which backend refused it.
    if backend is not None:
        n = found.out_features
        reason = backend.unsupported_cols_reason(n)
        if reason is not None:
            return f"backend {backend.name}: N = {n} {reason}", None
    return None, found


def own_forward_reason(layer: Any, base: type) -> str | None:
    """None if ``layer``'s class runs ``base.forward`` (vLLM's RowParallelLinear), else why it
    stays stock: a subclass with a forward of its own (vLLM's PCP o_proj gathers weights and
    reduces over its own group; out-of-tree layers registered with ``register_oot``) would
    have it replaced, silently, by the op's (a pure gate)."""
    if type(layer).forward is base.forward:
        return None
    return (f"{type(layer).__name__} overrides {base.__name__}.forward (its own gathers or "
            "reduction), which routing would bypass")


def _routed_forward(self: Any, input_: torch.Tensor) -> Any:
    # The stock RowParallelLinear.forward (vllm/model_executor/layers/linear.py) returns
    # ``output`` or ``(output, output_bias)``; a routed layer has no bias, so output_bias
    # is None, as stock's ``self.bias if self.skip_bias_add else None`` is.
    x2d = input_.reshape(-1, input_.shape[-1]).contiguous()
    weight, weight_scale = getattr(self, OPERANDS_ATTR)(self)
    out = torch.ops.radiance.linear_ar(x2d, weight, weight_scale, getattr(self, ROUTED_ATTR))
    out = out.reshape(*input_.shape[:-1], out.shape[-1])
    return (out, None) if self.return_bias else out


def route(layer: Any, producer: str | Route, name: str = "",
          operands: Operands = plain_weight) -> str:
    """Make ``layer``'s forward one ``radiance::linear_ar`` call; the op owns the reduction.

    ``producer`` is a kernel producer's name (``operands`` reads its tensors off the
    layer) or a :class:`~radiance_ar.overlap.vllm_routes.Route`. A :data:`GENERIC` route binds the
    layer's own quant method as producer ``quant_method:<name>`` (``name``: the layer's
    name in its model, the same in every process and run). Returns the producer name
    the forward passes."""
    if isinstance(producer, Route):
        producer, operands = producer.producer, producer.operands
    if producer == GENERIC:
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        # The op's weight argument: (N, K) and the device, no copy of the weights.
        setattr(layer, CARRIER_ATTR, shape_carrier(n, k, device_of(layer)))
        producer = bind_layer(name, layer, n, k)
    setattr(layer, ROUTED_ATTR, producer)
    setattr(layer, OPERANDS_ATTR, operands)
    layer.reduce_results = False
    layer.forward = types.MethodType(_routed_forward, layer)
    return producer


@dataclass
class InstallReport:
    settings: OverlapSettings
    tp_size: int = 0
    routed: list[str] = field(default_factory=list)  # routed by this call
    #: layer name -> producer kind (a kernel's name, or GENERIC), for the routed ones
    producers: dict[str, str] = field(default_factory=dict)
    already: list[str] = field(default_factory=list)  # routed by an earlier call
    left: dict[str, list[str]] = field(default_factory=dict)  # reason -> layer names
    #: RADIANCE_AR_BACKEND=auto: (N, producer) of routed layers -> the choice at every
    #: measured M (radiance_ar/overlap/tuning.py), and the table's description
    auto: dict[tuple[int, str], list] = field(default_factory=dict)
    auto_table: str = ""
    #: why the op's calls are not replayed here (OverlapRuntime.graph_reason; None: they
    #: are, or no runtime was built)
    graph_reason: str | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def summary(self) -> str:
        s = self.settings
        if not s.enabled:
            return "radiance-ar: RADIANCE_AR_OVERLAP=0, every RowParallel linear left stock"
        total = len(self.routed) + len(self.already) + sum(map(len, self.left.values()))
        if s.backend == AUTO_BACKEND:
            return self._auto_summary(total)
        cls = backends.get(s.backend)
        slices = ("unsliced" if not cls.pipelined
                  else f"slices {s.slices}" if s.slices != "auto"
                  else "slices auto = " + auto_slices_text(cls, self.tp_size, s.min_m, s.plan))
        if cls.pipelined and s.plan != OVERLAP_PLANS[0]:
            slices += f" {s.plan}"
        head = (f"radiance-ar: routed {len(self.routed)} of {total} RowParallel linears "
                f"through radiance::linear_ar (backend {s.backend}, tp {self.tp_size}, "
                f"{slices}, min_m {s.min_m})")
        if cls.pipelined:  # what the replayed calls may hold (radiance_ar/overlap/graphs.py)
            head += f"; op graphs {s.graphs}"
            if s.graphs != "off" and self.graph_reason is not None:
                head += f": none here ({self.graph_reason})"
            elif s.graphs != "off":
                most = min(s.graphs_per_layer * len(self.routed), MAX_OP_GRAPHS)
                head += (f": up to {s.graphs_per_layer} per routed linear ({most} here, "
                         f"RADIANCE_AR_OP_GRAPHS_PER_LAYER; {MAX_OP_GRAPHS} at most)")
        if self.producers:
            kinds = sorted(set(self.producers.values()))
            head += "; producers: " + ", ".join(
                f"{k} {list(self.producers.values()).count(k)}" for k in kinds)
        return self._tail(head)

    def _tail(self, head: str) -> str:
        if self.already:
            head += f"; {len(self.already)} were routed already"
        parts = [head]
        for reason, names in sorted(self.left.items(), key=lambda kv: -len(kv[1])):
            parts.append(f"left stock: {len(names)} ({reason}), e.g. {names[0]}")
        return "; ".join(parts)

    def _auto_summary(self, total: int) -> str:
        """``auto``: per layer shape (N, producer), the choice at each measured M and why."""
        s = self.settings
        head = (f"radiance-ar: routed {len(self.routed)} of {total} RowParallel linears "
                f"through radiance::linear_ar (backend auto, accuracy {s.accuracy}, tp "
                f"{self.tp_size}, min_m {s.min_m}, from {self.auto_table})")
        for (n, producer), choices in sorted(self.auto.items()):
            head += f"; auto N = {n} {producer}: " + ", ".join(
                f"M ~{c.measured_m}: {c.backend} "
                f"{'unsliced' if c.slices == 1 else f'S={c.slices} {c.plan}'} ({c.reason})"
                for c in choices)
        return self._tail(head)


def plan(layers: Iterable[tuple[str, Any]], tp_size: int,
         report: InstallReport) -> list[tuple[str, Any, Route]]:
    """(name, layer, route) for every eligible layer; the rest go into ``report``.

    Eligibility includes the backend ``report.settings`` names (its gate on N).
    """
    auto = report.settings.backend == AUTO_BACKEND
    backend = None if auto else backends.get(report.settings.backend)
    chosen = []
    for name, layer in layers:
        reason, route_ = _decide(layer, tp_size, backend)
        if auto and reason is None:
            reason = _auto_choices(report, tp_size, route_)
        if reason is None:
            chosen.append((name, layer, route_))
        elif reason == ALREADY_ROUTED:
            report.already.append(name)
        else:
            report.left.setdefault(reason, []).append(name)
    return chosen


def _auto_choices(report: InstallReport, tp_size: int, route_: Route) -> str | None:
    """``auto``: the layer's choices into ``report.auto`` (None), or why it stays stock:
    the table has no row for its N at this TP size (the op would refuse its calls)."""
    from radiance_ar.overlap import auto, tuning

    key = (route_.out_features, route_.producer)
    if key not in report.auto:
        table = auto.table_for(report.settings)
        report.auto_table = table.describe()
        try:
            report.auto[key] = tuning.measured_choices(table, tp_size, *key,
                                                       report.settings.accuracy)
        except ValueError as e:
            return (f"backend auto: {table.describe()} has no {report.settings.accuracy} row "
                    f"for tp {tp_size}, N = {key[0]}, producer {key[1]} ({e})")
    return None


def captured_sizes(vllm_config: Any) -> list[int]:
    """The batch sizes (tokens) vLLM may capture into CUDA graphs by ``vllm_config`` as it
    stands when the model loads: none under ``enforce_eager`` or ``cudagraph_mode`` NONE
    (read duck-typed, as vLLM 0.32 names them: ``compilation_config.cudagraph_capture_sizes``).
    An upper bound: vLLM settles its mode after loading, and a decode-only mode captures only
    the sizes of a decode batch."""
    if vllm_config is None or getattr(getattr(vllm_config, "model_config", None),
                                      "enforce_eager", False):
        return []
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", mode) == "NONE":
        return []
    return sorted(int(s) for s in getattr(compilation, "cudagraph_capture_sizes", None) or [])


def capture_conflict(sizes: Iterable[int], min_m: int, backend: str,
                     reason: str | None) -> str | None:
    """None, or why vLLM's CUDA-graph capture of batch ``sizes`` would meet the op's refusal
    (a pure gate): a size at or above ``min_m`` takes the sliced path inside the capture,
    which ``backend`` refuses for ``reason`` (``OverlapRuntime.caller_capture_reason``)."""
    hit = [s for s in sizes if s >= min_m]
    if not hit or reason is None:
        return None
    return (f"vLLM may capture batch sizes {hit} into CUDA graphs, at or above "
            f"RADIANCE_AR_OVERLAP_MIN_M = {min_m}, where backend {backend!r}'s sliced path would "
            f"run inside the capture, which it refuses: {reason}; a capture of one will raise. "
            f"Set RADIANCE_AR_OVERLAP_MIN_M above {max(hit)}, or vLLM's "
            f"max_cudagraph_capture_size below {min_m}")


def _configure_on_tp_group(settings: OverlapSettings) -> None:
    """Collective over vLLM's TP group, once per process and settings (the process runtime
    remembers the group: :class:`radiance_ar.overlap.runtime.ProcessRuntime`): the op's runtime on
    that group, whose vendor all-reduce (the decode path, ``stock``) is vLLM's own."""
    from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

    from radiance_ar.transport.world import from_process_group
    from radiance_ar.overlap.runtime import PROCESS

    tp = get_tp_group()
    if PROCESS.is_configured_for(tp, settings):
        return  # before building a world: that would rendezvous peer memory again
    device = torch.device(tp.device)
    # NCCL/RCCL for GPU ranks (symmetric memory rendezvous); gloo for CPU ranks.
    group = tp.device_group if device.type == "cuda" else tp.cpu_group
    world = from_process_group(group, device, all_reduce=tensor_model_parallel_all_reduce)
    PROCESS.configure(world, settings, key=tp)


def install(model: torch.nn.Module, *, settings: OverlapSettings | None = None,
            vllm_config: Any = None) -> InstallReport:
    """Route every eligible vLLM RowParallelLinear of ``model`` through the overlap op.

    Does nothing when RADIANCE_AR_OVERLAP is 0. Otherwise collective over vLLM's TP
    group (every TP rank loads the same model and calls this): it builds the op's
    runtime on that group before touching any layer, so a backend that cannot run here
    stops start-up with the layers unchanged. Idempotent. ``vllm_config`` (optional)
    lets it see LoRA, whose wrappers bypass the layer's forward, and the batch sizes vLLM
    may capture into CUDA graphs: where one would take the sliced path and the backend
    refuses a caller's capture (:func:`capture_conflict`), a warning says so and what to set.
    """
    settings = from_env() if settings is None else settings
    report = InstallReport(settings)
    if not settings.enabled:
        logger.info(report.summary())
        return report
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.model_executor.layers.linear import RowParallelLinear
    except ImportError as e:
        raise ImportError("radiance_ar.overlap.vllm_install.install: RADIANCE_AR_OVERLAP=1 but vLLM "
                          f"cannot be imported ({e})") from e
    report.tp_size = get_tensor_model_parallel_world_size()
    layers = []
    for n, m in model.named_modules():
        if isinstance(m, RowParallelLinear):
            reason = own_forward_reason(m, RowParallelLinear)
            if reason is None:
                layers.append((n, m))
            else:
                report.left.setdefault(reason, []).append(n)
    if vllm_config is not None and getattr(vllm_config, "lora_config", None) is not None:
        if layers:
            report.left[LORA] = [n for n, _ in layers]
        logger.info(report.summary())
        return report
    chosen = plan(layers, report.tp_size, report)
    from radiance_ar.overlap.runtime import PROCESS
    if chosen:
        _configure_on_tp_group(settings)
        # Said now, not raised: the sizes are an upper bound of what vLLM will capture
        # (captured_sizes), and a capture that does meet the refusal raises with its reason.
        # Under auto each size's choice has its own gate, met at the capture itself.
        rt = PROCESS.current()
        report.graph_reason = rt.graph_reason()
        if rt.world.device.type == "cuda" and rt.auto is None:
            conflict = capture_conflict(captured_sizes(vllm_config), rt.settings.min_m,
                                        rt.backend.name, rt.caller_capture_reason())
            if conflict is not None:
                logger.warning("radiance-ar: %s", conflict)
    for name, layer, route_ in chosen:
        route(layer, route_, name)
        # numbered in model order, the same on every rank: each call's signature carries
        # its layer's number, so a rank that skipped a call meets a mismatch at the next
        PROCESS.current().register_layer(getattr(layer, OPERANDS_ATTR)(layer)[0])
        report.routed.append(name)
        report.producers[name] = route_.producer
    logger.info(report.summary())
    return report
