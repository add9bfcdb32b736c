"""One tensor-parallel rank's decoder layers, written as steps so that ranks can run in lockstep.

Per layer (Llama / Qwen3 dense decoder, one TP shard, random weights)::

    x = rms_norm(h)                                  norms
    qkv = x @ W_qkv.T                                qkv        ColumnParallel (heads / tp)
    attn = sdpa(rope([q/k norm] q, k), v, causal)    attention  GQA through enable_gqa
    h = h + row_parallel(attn, W_o)                  o_proj_ar  the op: GEMM + all-reduce
    x = rms_norm(h)                                  norms      (the add is counted here)
    a = silu(g) * u, [g u] = x @ W_gate_up.T         mlp_gemms  ColumnParallel
    h = h + row_parallel(a, W_down)                  down_proj_ar the op
                                                     norms      (the residual add)

Every GEMM goes through the chosen GEMM producer (:mod:`radiance_ar.overlap.producers`), the
RowParallel ones inside the op. RoPE is NeoX-style with the model's ``rope_theta``;
Llama 3.1's ``rope_scaling`` (a rescaling of the frequencies) is left out: it changes
the values, not the cost. On GPUs SDPA may pick only its fused kernels (flash, cuDNN,
memory-efficient). Embedding, final norm and LM head are not part of the stack. Each chunk of the prefill is its own causal sequence
(positions 0..rows-1, attention within the chunk only): a batch of prefill requests of
``chunk`` tokens each. A chunk that continues a long prompt would also attend to the
earlier chunks' KV, so its attention costs more and the all-reduce's share of the
prefill is lower than here.

:func:`prefill_steps` is a generator that yields the name of each component as it
finishes, so a driver can record a device event between components
(:func:`run_alone`) or advance W emulated ranks one component at a time, each on its
own stream (:func:`run_lockstep`): every rank then issues each collective call before
any rank needs its result.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Callable, Generator

import torch
import torch.nn.functional as F

from radiance_ar.streams import current_stream_handle
import producer_inputs
from model_shapes import RankShapes
from radiance_ar.overlap import producers
from radiance_ar.overlap.scratch import ScratchPool

#: the per-layer components, in the order the report lists them
COMPONENTS = ("norms", "qkv", "attention", "o_proj_ar", "mlp_gemms", "down_proj_ar")
#: how the attention handles grouped KV heads: SDPA's own GQA, or KV repeated per group
GQA_MODES = ("enable_gqa", "repeat_kv")
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Weight:
    """A linear's weight in its producer's format (``scale``: per output channel, or None)."""
    weight: torch.Tensor
    scale: torch.Tensor | None = None


#: relative step of each producer's activation quantization (absent: activations not
#: quantized). A difference d in a quantized input flips about d / step of its values by
#: one step, so two stacks that differ by d per all-reduce differ by about
#: sqrt(d * step) after the next GEMM (see prefill_measure.Spec.stack_bound). Every
#: quantizing producer here takes e4m3 activations: 3 mantissa bits, values 2^-3 apart
#: relative to their binade.
ACTIVATION_STEP = {"fp8_rowwise": 2.0 ** -3, "fp8_tensorwise": 2.0 ** -3,
                   "mxfp4_w4a8": 2.0 ** -3}


def producer_weight(name: str, w: torch.Tensor) -> Weight:
    """A bf16 weight in producer ``name``'s format (:func:`producer_inputs.weight_format`;
    a producer without one and without a weight scale takes the bf16 weight as it is)."""
    known = name in producer_inputs.known()
    return Weight(*producer_inputs.weight_format(name if known else "bf16", w))


def activation_step(name: str) -> float | None:
    """The relative step of producer ``name``'s activation quantization, or None."""
    return ACTIVATION_STEP.get(name)


def producer_problem(name: str) -> str | None:
    """Why this tool cannot run GEMM producer ``name`` (None: it can)."""
    if name not in producers.names():
        return f"unknown producer {name!r}; registered: {', '.join(producers.names())}"
    if producers.get(name).needs_weight_scale and name not in producer_inputs.known():
        return (f"producer {name!r} needs scaled weights in a format this tool does not "
                f"build (known: "
                f"{', '.join(producer_inputs.known())}); add it to tools/producer_inputs.py")
    return None


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Weight
    o_proj: Weight
    gate_up: Weight
    down_proj: Weight
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def _generator(device: torch.device, *seed: int) -> torch.Generator:
    digest = hashlib.blake2b(repr(seed).encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little") >> 1)
    return g


def _normal(shape: tuple[int, ...], device: torch.device, *seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(device, *seed), device=device, dtype=DTYPE)


class ShardModel:
    """Rank ``rank``'s shard of ``layers`` decoder layers with random weights.

    Weights are N(0, 1/K) (activations keep unit scale through every GEMM); norm weights
    are 1 + N(0, 0.1^2) and the same on every rank (replicated in TP). ``seed`` and the
    rank fix every value, so any process rebuilds any rank's shard."""

    def __init__(self, shapes: RankShapes, layers: int, rank: int, device: torch.device,
                 producer: str = "bf16", seed: int = 0, gqa: str = "enable_gqa"):
        problem = producer_problem(producer)
        if problem is not None:
            raise ValueError(problem)
        if gqa not in GQA_MODES:
            raise ValueError(f"gqa {gqa!r}: expected one of {', '.join(GQA_MODES)}")
        self.shapes, self.device, self.gqa = shapes, torch.device(device), gqa
        self.producer = producers.get(producer)
        self.scratch = ScratchPool()
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers = []
        for i in range(layers):
            def linear(name: str, which: int) -> Weight:
                n, k = shapes.gemms()[name]
                return producer_weight(
                    producer, _normal((n, k), self.device, seed, i, rank, which) * k ** -0.5)

            def norm(size: int, which: int) -> torch.Tensor:
                return 1 + 0.1 * _normal((size,), self.device, seed, i, -1, which)

            self.layers.append(Layer(
                input_norm=norm(shapes.hidden, 0), post_norm=norm(shapes.hidden, 1),
                qkv=linear("qkv", 2), o_proj=linear("o_proj", 3),
                gate_up=linear("gate_up", 4), down_proj=linear("down_proj", 5),
                q_norm=norm(shapes.head_dim, 6) if shapes.model.qk_norm else None,
                k_norm=norm(shapes.head_dim, 7) if shapes.model.qk_norm else None))

    def inner(self, w: Weight) -> int:
        """K of the linear ``w``: its stored columns times the producer's values per
        element (mxfp4_w4a8 packs two)."""
        return w.weight.shape[1] * self.producer.values_per_weight_element

    def gemm(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """``x @ w.T`` through the producer, on the current stream (ColumnParallel)."""
        prepared = self.producer.prepare(x, w.weight, w.scale, self.scratch)
        out = torch.empty((x.shape[0], w.weight.shape[0]), dtype=x.dtype, device=x.device)
        self.producer.launch(prepared, 0, x.shape[0], out, current_stream_handle(x.device))
        return out

    def rope(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0..rows-1, (rows, 1, head_dim), built once per length
        (vLLM keeps them cached too): call before timing."""
        if rows not in self._rope:
            d = self.shapes.head_dim
            inv_freq = self.shapes.model.rope_theta ** (
                -torch.arange(0, d, 2, dtype=torch.float64, device=self.device) / d)
            angles = torch.arange(rows, dtype=torch.float64, device=self.device)[:, None] * inv_freq
            angles = torch.cat([angles, angles], dim=1)[:, None, :]
            self._rope[rows] = (angles.cos().to(DTYPE), angles.sin().to(DTYPE))
        return self._rope[rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE (Llama's ``rotate_half``) of ``x`` (rows, heads, head_dim)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _sdpa_backends() -> contextlib.AbstractContextManager:
    """On GPUs only the fused kernels: the math fallback would materialize the
    rows x rows scores per head and time something no server runs (no silent fallback:
    torch raises if none of them serves the call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION])


def attention(model: ShardModel, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of one chunk: (rows, q_dim + 2 kv_dim) -> (rows, q_dim)."""
    s, rows = model.shapes, qkv.shape[0]
    q, k, v = qkv.split([s.q_dim, s.kv_dim, s.kv_dim], dim=1)
    q = q.view(rows, s.q_heads, s.head_dim)
    k = k.view(rows, s.kv_heads, s.head_dim)
    v = v.view(rows, s.kv_heads, s.head_dim)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, s.model.rms_eps)
        k = rms_norm(k, layer.k_norm, s.model.rms_eps)
    cos, sin = model.rope(rows)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, rows, d)
    gqa = s.q_heads != s.kv_heads
    if gqa and model.gqa == "repeat_kv":
        k = k.repeat_interleave(s.q_heads // s.kv_heads, dim=1)
        v = v.repeat_interleave(s.q_heads // s.kv_heads, dim=1)
    with _sdpa_backends() if qkv.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=gqa and model.gqa == "enable_gqa")
    return out.squeeze(0).transpose(0, 1).reshape(rows, s.q_dim)


#: ``row_parallel(x, weight) -> sum over ranks of x @ weight.T``: the op, or a reference
RowParallel = Callable[[torch.Tensor, Weight], torch.Tensor]
Steps = Generator[str, None, "list[torch.Tensor]"]


def layer_steps(model: ShardModel, layer: Layer, h: torch.Tensor,
                row_parallel: RowParallel) -> Generator[str, None, torch.Tensor]:
    eps = model.shapes.model.rms_eps
    x = rms_norm(h, layer.input_norm, eps)
    yield "norms"
    qkv = model.gemm(x, layer.qkv)
    yield "qkv"
    attn = attention(model, layer, qkv)
    yield "attention"
    o = row_parallel(attn, layer.o_proj)
    yield "o_proj_ar"
    h = h + o
    x = rms_norm(h, layer.post_norm, eps)
    yield "norms"
    gate, up = model.gemm(x, layer.gate_up).chunk(2, dim=1)
    a = F.silu(gate) * up
    yield "mlp_gemms"
    d = row_parallel(a, layer.down_proj)
    yield "down_proj_ar"
    h = h + d
    yield "norms"
    return h


def prefill_steps(model: ShardModel, chunks: list[torch.Tensor],
                  row_parallel: RowParallel) -> Steps:
    """Every chunk through every layer; returns each chunk's final hidden states."""
    outs = []
    for h in chunks:
        for layer in model.layers:
            h = yield from layer_steps(model, layer, h, row_parallel)
        outs.append(h)
    return outs


def make_chunks(hidden: int, chunk_rows: list[int], device: torch.device,
                seed: int = 0) -> list[torch.Tensor]:
    """The prefill's input hidden states, one tensor per chunk, the same on every rank."""
    return [_normal((rows, hidden), torch.device(device), seed, c, -2)
            for c, rows in enumerate(chunk_rows)]


def run_alone(steps: Steps, on_step: Callable[[str], None] | None = None) -> list[torch.Tensor]:
    """Run one rank's steps to the end; ``on_step(name)`` after each component."""
    while True:
        try:
            name = next(steps)
        except StopIteration as stop:
            return stop.value
        if on_step is not None:
            on_step(name)


def run_lockstep(rank_steps: list[Steps], streams: list | None = None,
                 after_step: Callable[[], None] | None = None) -> list[list[torch.Tensor]]:
    """Advance every rank one component at a time, rank 0 first, each inside its own
    stream (``streams``; None: the current one); ``after_step()`` once every rank made
    the step. Returns each rank's outputs."""
    results: list = [None] * len(rank_steps)
    while True:
        finished = 0
        for r, steps in enumerate(rank_steps):
            ctx = torch.cuda.stream(streams[r]) if streams else contextlib.nullcontext()
            with ctx:
                try:
                    next(steps)
                except StopIteration as stop:
                    results[r] = stop.value
                    finished += 1
        if finished:
            assert finished == len(rank_steps), "ranks ran different numbers of steps"
            return results
        if after_step is not None:
            after_step()
