"""Dense decoder shapes for the prefill benchmark: public configs, a config.json reader,
and what one tensor-parallel rank holds.

Built-in table (values of each model's public ``config.json``; ``tp`` lists the TP
degrees the benchmark is meant to run it at, the first being the default):

| name | hidden | intermediate | heads | kv heads | head dim | layers | rms eps | rope theta | q/k norm | tp |
|---|---|---|---|---|---|---|---|---|---|---|
| llama-3.1-8b | 4096 | 14336 | 32 | 8 | 128 | 32 | 1e-5 | 500000 | no | 2 |
| llama-3.1-70b | 8192 | 28672 | 64 | 8 | 128 | 80 | 1e-5 | 500000 | no | 4, 8 |
| qwen3-32b | 5120 | 25600 | 64 | 8 | 128 | 64 | 1e-6 | 1000000 | yes | 4 |
| tiny | 256 | 512 | 4 | 2 | 64 | 2 | 1e-6 | 10000 | no | 2 |

``tiny`` is no public model: it is the CPU world's correctness shape (every width a
multiple of 256, the wht6 codec's block, so every backend serves it).

A tensor-parallel rank (vLLM's sharding) holds ``heads / tp`` query heads and
``kv_heads / tp`` KV heads (one replicated KV head per rank where ``tp > kv_heads``),
``intermediate / tp`` MLP columns, and the full hidden size on both RowParallel
outputs (o_proj, down_proj), whose all-reduce the op overlaps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    rms_eps: float
    rope_theta: float
    #: per-head RMSNorm of q and k before RoPE (Qwen3)
    qk_norm: bool = False
    #: TP degrees this entry is meant for; the first is the default
    tp: tuple[int, ...] = ()


MODELS: dict[str, ModelConfig] = {m.name: m for m in (
    ModelConfig("llama-3.1-8b", 4096, 14336, 32, 8, 128, 32, 1e-5, 500000.0, tp=(2,)),
    ModelConfig("llama-3.1-70b", 8192, 28672, 64, 8, 128, 80, 1e-5, 500000.0, tp=(4, 8)),
    ModelConfig("qwen3-32b", 5120, 25600, 64, 8, 128, 64, 1e-6, 1000000.0, qk_norm=True,
                tp=(4,)),
    ModelConfig("tiny", 256, 512, 4, 2, 64, 2, 1e-6, 10000.0, tp=(2,)),
)}

#: ``model_type`` values whose attention normalizes q and k per head (Qwen3's q_norm/k_norm)
QK_NORM_MODEL_TYPES = ("qwen3",)
#: keys that mark a mixture-of-experts config (its MLP is not one dense GEMM pair)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads",
                 "num_hidden_layers", "rms_norm_eps")


def model(name: str) -> ModelConfig:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; built in: {', '.join(MODELS)} "
                         "(or pass --config PATH to an HF-style config.json)") from None


def _positive_int(path: str, cfg: dict, key: str) -> int:
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{path}: key {key!r} is {value!r}, expected an integer >= 1")
    return value


def _positive_float(path: str, cfg: dict, key: str) -> float:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}: key {key!r} is {value!r}, expected a finite number > 0")
    return float(value)


def read_config(path: str) -> ModelConfig:
    """A :class:`ModelConfig` from an HF-style ``config.json`` (a multimodal one's
    ``text_config`` when the top level has no ``hidden_size``).

    Required: ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_hidden_layers``, ``rms_norm_eps``. Defaults as transformers documents them:
    ``num_key_value_heads`` = ``num_attention_heads``, ``head_dim`` = hidden /
    heads, ``rope_theta`` = 10000. A missing file, bad JSON, a missing or bad key, or a
    mixture-of-experts config raises ``ValueError`` naming the file and the key."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the config: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    cfg = raw
    if "hidden_size" not in raw and isinstance(raw.get("text_config"), dict):
        cfg = raw["text_config"]
    for key in REQUIRED_KEYS:
        if key not in cfg:
            raise ValueError(f"{path}: missing key {key!r} (required: {', '.join(REQUIRED_KEYS)})")
    for key in MOE_KEYS:
        if cfg.get(key):
            raise ValueError(f"{path}: key {key!r} = {cfg[key]!r} marks a mixture-of-experts "
                             "model; this benchmark models dense MLPs only")
    hidden = _positive_int(path, cfg, "hidden_size")
    heads = _positive_int(path, cfg, "num_attention_heads")
    kv_heads = _positive_int(path, cfg, "num_key_value_heads") \
        if "num_key_value_heads" in cfg else heads
    if "head_dim" in cfg and cfg["head_dim"] is not None:
        head_dim = _positive_int(path, cfg, "head_dim")
    elif hidden % heads:
        raise ValueError(f"{path}: missing key 'head_dim' and hidden_size {hidden} is not a "
                         f"multiple of num_attention_heads {heads}")
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ValueError(f"{path}: key 'num_key_value_heads' = {kv_heads} does not divide "
                         f"num_attention_heads = {heads}")
    rope_theta = _positive_float(path, cfg, "rope_theta") if "rope_theta" in cfg else 10000.0
    return ModelConfig(
        name=str(cfg.get("_name_or_path") or raw.get("_name_or_path") or path),
        hidden=hidden, intermediate=_positive_int(path, cfg, "intermediate_size"),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        layers=_positive_int(path, cfg, "num_hidden_layers"),
        rms_eps=_positive_float(path, cfg, "rms_norm_eps"), rope_theta=rope_theta,
        qk_norm=cfg.get("model_type") in QK_NORM_MODEL_TYPES)


@dataclass(frozen=True)
class RankShapes:
    """What one TP rank of ``model`` holds; every GEMM is ``(rows, k) @ (n, k).T``."""
    model: ModelConfig
    tp: int
    q_heads: int  # query heads on this rank
    kv_heads: int  # KV heads on this rank (replicated where tp > the model's kv heads)
    intermediate: int  # MLP columns on this rank

    @property
    def hidden(self) -> int:
        return self.model.hidden

    @property
    def head_dim(self) -> int:
        return self.model.head_dim

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def gemms(self) -> dict[str, tuple[int, int]]:
        """(n, k) of each linear on this rank: ColumnParallel qkv and gate_up, RowParallel
        o_proj and down_proj (n = hidden: the all-reduced width)."""
        return {"qkv": (self.q_dim + 2 * self.kv_dim, self.hidden),
                "o_proj": (self.hidden, self.q_dim),
                "gate_up": (2 * self.intermediate, self.hidden),
                "down_proj": (self.hidden, self.intermediate)}


def rank_shapes(cfg: ModelConfig, tp: int) -> RankShapes:
    """One rank's shard of ``cfg`` at TP degree ``tp`` (vLLM's rules; ``ValueError`` where
    ``tp`` does not split the model)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if cfg.heads % tp:
        raise ValueError(f"{cfg.name}: {cfg.heads} attention heads do not split over tp {tp}")
    if cfg.intermediate % tp:
        raise ValueError(f"{cfg.name}: intermediate size {cfg.intermediate} does not split "
                         f"over tp {tp}")
    if cfg.kv_heads >= tp:
        if cfg.kv_heads % tp:
            raise ValueError(f"{cfg.name}: {cfg.kv_heads} KV heads do not split over tp {tp}")
        kv = cfg.kv_heads // tp
    elif tp % cfg.kv_heads:
        raise ValueError(f"{cfg.name}: tp {tp} is not a multiple of its {cfg.kv_heads} KV "
                         "heads, so they cannot be replicated evenly")
    else:
        kv = 1
    return RankShapes(cfg, tp, cfg.heads // tp, kv, cfg.intermediate // tp)


#: (model, TP degree) of the prefill bench's MXFP4 sweeps (tools/bench_mxfp4.py --sweep,
#: tools/tune_mxfp4_fp8.py)
PREFILL_TP = (("llama-3.1-8b", 2), ("llama-3.1-70b", 4), ("qwen3-32b", 4))


def row_parallel_shapes(models=PREFILL_TP) -> list[tuple[str, str, int, int]]:
    """(``"<model> tp<TP>"``, layer, N, K) of one rank's row-parallel linears, o_proj and
    down_proj, of each (model, TP degree) of ``models``."""
    out = []
    for name, tp in models:
        gemms = rank_shapes(model(name), tp).gemms()
        out += [(f"{name} tp{tp}", layer, *gemms[layer]) for layer in ("o_proj", "down_proj")]
    return out
