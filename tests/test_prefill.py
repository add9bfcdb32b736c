"""tools/prefill_bench.py and its modules: shapes per TP against hand arithmetic, the
config reader's errors, the attention against a plain float64 one, the stack in a CPU
world of 2 processes (overlap on vs off and vs an exact-sum stack rebuilt here), the
lockstep checker, the command line; and on a GPU the emulated world end to end."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from radiance_ar import backends
import model_shapes
import prefill_bench
import prefill_emulated
import prefill_measure
import prefill_report
import prefill_stack
from radiance_ar.transport.world import World
from radiance_ar.overlap import producers

TINY = model_shapes.rank_shapes(model_shapes.MODELS["tiny"], 2)


# ----------------------------------------------------------------------- shapes, configs

def test_llama_70b_shards_by_hand():
    cfg = model_shapes.model("Llama-3.1-70B")
    tp4 = model_shapes.rank_shapes(cfg, 4)
    # 64 heads / 4 = 16 query heads, 8 KV heads / 4 = 2, head dim 128, 28672 / 4 = 7168
    assert (tp4.q_heads, tp4.kv_heads, tp4.intermediate) == (16, 2, 7168)
    assert tp4.gemms() == {"qkv": ((16 + 2 * 2) * 128, 8192), "o_proj": (8192, 16 * 128),
                           "gate_up": (2 * 7168, 8192), "down_proj": (8192, 7168)}
    tp8 = model_shapes.rank_shapes(cfg, 8)  # one KV head per rank
    assert tp8.gemms()["qkv"] == ((8 + 2 * 1) * 128, 8192)
    # 8 KV heads over tp 16: each rank holds one replicated KV head
    wide = model_shapes.rank_shapes(model_shapes.model("llama-3.1-8b"), 16)
    assert (wide.q_heads, wide.kv_heads) == (2, 1)
    with pytest.raises(ValueError, match="64 attention heads do not split over tp 3"):
        model_shapes.rank_shapes(cfg, 3)
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        model_shapes.model("nope")


def write(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


QWEN3 = {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600,
         "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
         "num_hidden_layers": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000}


def test_config_reader_matches_the_table_and_applies_hf_defaults(tmp_path):
    cfg = model_shapes.read_config(write(tmp_path, QWEN3))
    ref = model_shapes.MODELS["qwen3-32b"]
    assert [getattr(cfg, k) for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim",
                                      "layers", "rms_eps", "rope_theta", "qk_norm")] == \
        [getattr(ref, k) for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim",
                                   "layers", "rms_eps", "rope_theta", "qk_norm")]
    bare = {k: QWEN3[k] for k in model_shapes.REQUIRED_KEYS}
    cfg = model_shapes.read_config(write(tmp_path, {"text_config": bare}))
    assert (cfg.kv_heads, cfg.head_dim, cfg.rope_theta, cfg.qk_norm) == (64, 80, 10000.0, False)


@pytest.mark.parametrize("content,words", [
    (None, "cannot read the config"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({k: v for k, v in QWEN3.items() if k != "intermediate_size"}, "missing key 'intermediate_size'"),
    (dict(QWEN3, num_hidden_layers=0), "key 'num_hidden_layers' is 0"),
    (dict(QWEN3, rms_norm_eps="1e-6"), "key 'rms_norm_eps' is '1e-6'"),
    (dict(QWEN3, num_key_value_heads=5), "'num_key_value_heads' = 5 does not divide"),
    (dict(QWEN3, num_experts=8), "mixture-of-experts"),
])
def test_bad_config_names_the_file_and_the_key(tmp_path, content, words):
    path = str(tmp_path / "absent.json") if content is None else write(tmp_path, content)
    with pytest.raises(ValueError) as e:
        model_shapes.read_config(path)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value)


# ----------------------------------------------------------------------- the layers

def plain_attention(shapes, layer, qkv: torch.Tensor) -> torch.Tensor:
    """float64 causal attention written out: KV repeated per group, explicit mask."""
    rows, d, eps = qkv.shape[0], shapes.head_dim, shapes.model.rms_eps
    q, k, v = qkv.double().split([shapes.q_dim, shapes.kv_dim, shapes.kv_dim], dim=1)
    q, k, v = (t.reshape(rows, -1, d) for t in (q, k, v))
    if layer.q_norm is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * layer.q_norm.double()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * layer.k_norm.double()
    pos = torch.arange(rows, dtype=torch.float64)[:, None]
    inv = shapes.model.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos * inv)[:, None, :]
    cos, sin = ang.cos(), ang.sin()

    def rope(t):
        a, b = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    q, k = rope(q), rope(k)
    group = shapes.q_heads // shapes.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(rows, rows).triu(1).bool(), -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(rows, -1)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("gqa", prefill_stack.GQA_MODES)
def test_attention_matches_plain_float64(qk_norm, gqa):
    cfg = model_shapes.ModelConfig("t", 256, 512, 4, 2, 64, 1, 1e-6, 10000.0, qk_norm=qk_norm)
    shapes = model_shapes.rank_shapes(cfg, 1)
    model = prefill_stack.ShardModel(shapes, 1, 0, "cpu", gqa=gqa)
    qkv = torch.randn(48, shapes.gemms()["qkv"][0]).to(torch.bfloat16)
    got = prefill_stack.attention(model, model.layers[0], qkv)
    ref = plain_attention(shapes, model.layers[0], qkv)
    assert got.shape == (48, shapes.q_dim)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2  # bf16 RoPE, SDPA: ~3e-3


def test_chunking_and_stack_bounds():
    assert prefill_measure.chunk_rows(160, 64) == (64, 64, 32)
    assert prefill_measure.chunk_rows(128, 64) == (64, 64)
    with pytest.raises(ValueError, match="must be >= 1"):
        prefill_measure.chunk_rows(0, 64)
    spec = prefill_measure.Spec(TINY, layers=4, chunk_rows=(64,))
    assert spec.stack_bound(2 ** -5) == pytest.approx(2 ** -5 * math.sqrt(8))
    fp8 = prefill_measure.Spec(TINY, layers=4, chunk_rows=(64,), producer="fp8_rowwise")
    assert fp8.stack_bound(2 ** -5) == pytest.approx(math.sqrt(2 ** -5 * 2 ** -3) * math.sqrt(8))


def exact_sum_ops(models):
    """Row-parallel calls of W in-process ranks in lockstep: the last rank's call writes
    every rank's result, the float64 sum of the ranks' partials, rounded once."""
    partials, outs = [], []

    def for_rank(rank):
        def row_parallel(x, w):
            partials.append(models[rank].gemm(x, w).double())
            outs.append(torch.empty(x.shape[0], w.weight.shape[0], dtype=x.dtype))
            out = outs[-1]
            if rank == len(models) - 1:
                total = sum(partials)
                for o in outs:
                    o.copy_(total)
                partials.clear()
                outs.clear()
            return out
        return row_parallel
    return [for_rank(r) for r in range(len(models))]


def exact_stack(spec: prefill_measure.Spec) -> torch.Tensor:
    models = [spec.model(r, torch.device("cpu")) for r in range(spec.shapes.tp)]
    steps = [prefill_stack.prefill_steps(m, spec.chunks(torch.device("cpu")), op)
             for m, op in zip(models, exact_sum_ops(models))]
    outs = prefill_stack.run_lockstep(steps)
    assert all(torch.equal(torch.cat(o), torch.cat(outs[0])) for o in outs)
    return torch.cat(outs[0])


def test_an_arms_slices_are_the_ops_choice_per_chunk():
    # auto: the op chooses per chunk (Backend.preferred_slices_for); the record lists the
    # chunks' counts where they differ, and the arm's settings leave the choice to the op
    spec = prefill_measure.Spec(TINY, layers=1, chunk_rows=(8192, 8192, 4096, 2048))
    assert prefill_measure.arm_slices(spec, "sdma_wht6") == "8/4/2"  # tp 2: a slice per 1024 rows
    assert prefill_measure.arm_slices(spec, "sdma") == 4
    assert prefill_measure.settings(spec, "sdma_wht6").slices == "auto"
    fixed = prefill_measure.Spec(TINY, layers=1, chunk_rows=(8192, 2048), slices=3)
    assert prefill_measure.arm_slices(fixed, "sdma_wht6") == 3
    assert prefill_measure.settings(fixed, "sdma_wht6").slices == 3


def test_an_on_arms_bound_uses_the_slices_it_cut_each_chunk_into():
    # tp 2, sdma_wht6 auto: 8 slices of the 8192-row chunk, 2 of the 2048-row one
    spec = prefill_measure.Spec(TINY, layers=3, chunk_rows=(8192, 2048))
    assert [prefill_measure.chunk_slices(spec, "sdma_wht6", r) for r in (8192, 2048)] == [8, 2]
    per = {"8192": {"t_ar_ms": 4.0, "t_o_proj_ms": 1.0, "t_down_proj_ms": 2.0},
           "2048": {"t_ar_ms": 1.0, "t_o_proj_ms": 0.25, "t_down_proj_ms": 0.5}}
    off = {"t_prefill_ms": 100.0, "per_chunk_rows": per}
    on = {"backend": "sdma_wht6", "t_prefill_ms": 95.0}
    model = SimpleNamespace(producer=producers.get("bf16"))
    prefill_measure.add_bound(spec, model, on, off)
    # by hand, AR-bound everywhere (bound = AR + GEMM / S; hidden = GEMM (1 - 1/S)):
    # 3 layers x (1.0 + 2.0) x 7/8 at 8192 rows, 3 x (0.25 + 0.5) x 1/2 at 2048
    hidden = 3 * 3.0 * 7 / 8 + 3 * 0.75 / 2
    assert on["bound_ms"] == pytest.approx(100.0 - hidden)
    assert on["speedup_bound"] == pytest.approx(100.0 / (100.0 - hidden))
    assert on["efficiency"] == pytest.approx((100.0 - hidden) / 95.0)
    # a process world's on backend with an all-reduce of its own (half the serial arm's)
    on2 = {"backend": "sdma_wht6", "t_prefill_ms": 95.0}
    prefill_measure.add_bound(spec, model, on2, off, {8192: 2.0, 2048: 0.5})
    # (AR-bound: its all-reduce then its first GEMM slice, against GEMMs + serial ARs)
    saved = (3 * (3.0 + 2 * 4.0 - (2.0 + 1.0 / 8) - (2.0 + 2.0 / 8))
             + 3 * (0.75 + 2 * 1.0 - (0.5 + 0.25 / 2) - (0.5 + 0.5 / 2)))
    assert on2["bound_ms"] == pytest.approx(100.0 - saved)


def test_the_off_arms_parts_and_an_on_arms_bound_run_every_timed_step(monkeypatch):
    # the GPU timing replaced by one call of each step, "taking" the times below in call
    # order (the all-reduce at each chunk size, then per chunk size the two GEMMs; then the
    # on arm's AR alone per chunk size): the steps the bench times on a GPU run here on the
    # CPU, each of their outputs checked, and unequal times tell min from max and the two
    # ARs apart
    calls, times = [], [2.0, 2.0] + [0.5, 3.0] * 2 + [1.5] * 2

    def one_call(fn, reps, warmup, before=None):
        calls.append(fn)
        fn(0)
        return times[len(calls) - 1], 0.0, 0.0

    monkeypatch.setattr(prefill_measure.gpu_timing, "device_and_host_ms", one_call)
    spec = prefill_measure.Spec(TINY, layers=2, chunk_rows=(64, 64, 32), slices=2)
    model = spec.model(0, torch.device("cpu"))
    reduced = []
    backend = SimpleNamespace(ensure_capacity=lambda *a: None, peer_visible_input=False,
                              all_reduce=lambda i, o: reduced.append(o.copy_(i)))
    off = {"t_prefill_ms": 50.0}
    off.update(prefill_measure.off_arm_parts(spec, model, backend))
    # per chunk size: the all-reduce and the two RowParallel GEMMs
    assert len(calls) == 2 * 3 and [r.shape[0] for r in reduced] == [32, 64]
    assert off["per_chunk_rows"] == {str(r): {"t_ar_ms": 2.0, "t_o_proj_ms": 0.5,
                                              "t_down_proj_ms": 3.0} for r in (32, 64)}
    # 3 chunks x 2 layers x 2 all-reduces of 2 ms; hideable min(GEMM, AR) per call:
    # min(0.5, 2) + min(3, 2) = 2.5 per chunk and layer (max would give 5)
    assert off["t_ar_total_ms"] == 24.0 and off["t_hideable_ms"] == 15.0
    on = {"backend": "sdma", "t_prefill_ms": 40.0}
    prefill_measure.add_bound(spec, model, on, off,
                              prefill_measure.ar_alone_ms(spec, backend, model.device))
    # halves, the on arm's AR alone 1.5: o_proj max(0.5 + 0.75, 1.5 + 0.25) = 1.75 saves
    # 0.5 + 2 - 1.75 = 0.75, down_proj max(3 + 0.75, 1.5 + 1.5) = 3.75 saves 1.25; 3 x 2 times
    assert on["bound_ms"] == pytest.approx(50.0 - 6 * (0.75 + 1.25))
    assert on["efficiency"] == pytest.approx(on["bound_ms"] / 40.0)


def test_lockstep_checker_accepts_exact_sums_and_catches_a_missing_reduce():
    spec = prefill_measure.Spec(TINY, layers=1, chunk_rows=(32, 16))
    models = [spec.model(r, torch.device("cpu")) for r in range(2)]
    chunks = spec.chunks(torch.device("cpu"))
    outs, rels, same = prefill_emulated.lockstep_checked(models, chunks, exact_sum_ops(models))
    assert len(rels) == 2 * 2 * 1 * 2 and max(rels) < 2 ** -8 and same  # calls x ranks
    assert torch.equal(outs[0], exact_stack(spec))
    # each rank keeping its own partial: every call wrong, and the ranks disagree
    outs, rels, same = prefill_emulated.lockstep_checked(models, chunks, [m.gemm for m in models])
    assert min(rels) > 0.3 and not same


# ----------------------------------------------------------------------- CPU world

def test_stack_on_equals_off_in_a_cpu_world(cpu_world):
    spec = prefill_measure.Spec(TINY, layers=2, chunk_rows=(64, 32),
                                backends=tuple(backends.names()), keep_outputs=True)
    ranks = cpu_world(2).run(prefill_measure.process_world_job, spec)
    records = ranks[0]
    off = records[0]
    assert (off["arm"], off["backend"], off["correct"]) == ("off", "stock", True)
    reference = exact_stack(spec)
    rel = ((off["output"].double() - reference.double()).norm() / reference.double().norm()).item()
    assert rel <= spec.stack_bound(backends.get("stock").rel_rms_bound)
    on = {r["backend"]: r for r in records if r["arm"] == "on"}
    # the gates, asked here of a world that only says what it is
    probe = World(0, 2, torch.device("cpu"), SimpleNamespace(kind="cpu-shm"), group=object())
    reasons = {n: backends.get(n).unsupported_reason(probe)
               or backends.get(n).unsupported_cols_reason(TINY.hidden)
               for n in backends.names() if backends.get(n).pipelined}
    assert set(on) == set(reasons) and "sdma" in on  # stock is the off arm, not an on arm
    for name, r in on.items():
        if reasons[name] is not None:
            assert r["skipped"] == reasons[name]
            continue
        bound = backends.get(name).rel_rms_bound
        assert r["correct"] and r["identical_on_ranks"] and r["call_rel_rms_max"] <= bound, r
        diff = (r["output"].double() - off["output"].double()).norm() / off["output"].double().norm()
        assert diff.item() == pytest.approx(r["stack_rel_rms_vs_off"])
        assert diff.item() <= spec.stack_bound(bound), name
        assert torch.equal(r["output"], ranks[1][records.index(r)]["output"]), name
        assert "t_prefill_ms" not in r  # CPU worlds report no timing


# ----------------------------------------------------------------------- command line

def test_producer_is_checked_against_the_registry(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        prefill_bench.parse_args(["--producer", "nope"])
    assert f"registered: {', '.join(producers.names())}" in capsys.readouterr().err
    monkeypatch.setitem(producers._PRODUCERS, "ext_bf16",
                        producers.External("ext_bf16", lambda *a: None))
    assert prefill_bench.parse_args(["--producer", "ext_bf16"]).producer == "ext_bf16"
    monkeypatch.setitem(producers._PRODUCERS, "ext_scaled",
                        producers.External("ext_scaled", lambda *a: None, needs_weight_scale=True))
    with pytest.raises(SystemExit):
        prefill_bench.parse_args(["--producer", "ext_scaled"])
    assert "add it to tools/producer_inputs.py" in capsys.readouterr().err


def test_cli_cpu_run_writes_results_and_bad_inputs_give_rc_2(tmp_path, capsys):
    out = tmp_path / "res"
    rc = prefill_bench.main(["--mode", "cpu", "--layers", "1", "--tokens", "48", "--chunk", "32",
                             "--backends", "sdma", "--out-dir", str(out), "--no-png"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "correctness only" in text and "tokens/s" not in text
    data = json.loads((out / "prefill.json").read_text())
    assert data["mode"]["chunk_rows"] == [32, 16] and data["mode"]["tp"] == 2
    assert [(r["arm"], r["backend"], r["correct"]) for r in data["records"]] == \
        [("off", "stock", True), ("on", "sdma", True)]
    assert (out / "prefill.csv").read_text().startswith("world,")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert prefill_bench.main(["--mode", "cpu", "--out-dir", str(blocker / "x")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert prefill_bench.main(["--mode", "cpu", "--config", str(tmp_path / "no.json"),
                               "--tp", "2", "--out-dir", str(out)]) == 2
    assert f"{tmp_path / 'no.json'}: cannot read the config" in capsys.readouterr().err
    # a process world times stock's off arm only: another base has nothing to stand on
    assert prefill_bench.main(["--mode", "cpu", "--baseline", "sdma", "--out-dir", str(out)]) == 2
    assert "--baseline sdma: a cpu world times one off arm, stock's" in capsys.readouterr().err


def timed_record(arm, backend, prefill_ms, **extra):
    parts = dict(zip(prefill_stack.COMPONENTS, (0.1, 0.2, 0.1, 0.25, 0.15, 0.2)))
    rec = {"arm": arm, "backend": backend, "slices": 4 if arm == "on" else 1, "correct": True,
           "t_prefill_ms": prefill_ms, "t_prefill_spread_ms": 0.01, "tokens_per_s": 1e3 / prefill_ms,
           "call_rel_rms_max": 1e-3, "call_bound": 2 ** -8, "stack_rel_rms_vs_off": None,
           "stack_bound": 0.01, "identical_on_ranks": True, "finite": True}
    rec.update({f"t_{c}_ms": share * prefill_ms for c, share in parts.items()})
    rec.update(extra)
    return rec


def test_gpu_report_from_synthetic_records(tmp_path):
    hdr = {"world": "gpu-emulated", "emulated": True, "label": "1 GPU, 4 emulated ranks",
           "device": "H200", "date": "today", "model": {"name": "llama-3.1-70b"}, "tp": 4,
           "layers": 4, "tokens": 16384, "chunk": 8192, "chunk_rows": [8192, 8192]}
    records = [timed_record("off", "sdma", 200.0, ar_share=0.5, ceiling_speedup=1.25),
               timed_record("on", "sdma", 160.0, speedup=1.25, stack_rel_rms_vs_off=0.0,
                            speedup_bound=1.3125, efficiency=0.952),
               {"arm": "on", "backend": "stock", "skipped": "no process group", "correct": None},
               dict(timed_record("off", "oneshot_wht6", 1.0), correct=False, finite=False,
                    t_prefill_ms=None)]
    text = prefill_report.summary(hdr, records)
    lines = text.splitlines()
    assert "tokens/s" in lines[0] and "AR share" in lines[0]
    sdma_on = next(line for line in lines if line.split()[:2] == ["on", "sdma"])
    assert "1.250x" in sdma_on and "160.00±0.01" in sdma_on
    assert "1.312x" in sdma_on and "0.95" in sdma_on and "ideal" in lines[0]
    assert "50.0%" in next(line for line in lines if line.split()[:2] == ["off", "sdma"])
    assert "40.00 (25%)" in text  # o_proj+AR of the 160 ms arm
    assert "skipped stock: no process group" in text and "WRONG off oneshot_wht6" in text
    if prefill_report.write_png(str(tmp_path / "p.png"), hdr, records):
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_the_prefill_plot_marks_each_arm_against_its_off_arm_and_the_base():
    pytest.importorskip("matplotlib")
    hdr = {"world": "gpu-emulated", "emulated": True, "label": "1 GPU, 4 emulated ranks",
           "device": "H200", "date": "today", "model": {"name": "llama-3.1-70b"}, "tp": 4,
           "layers": 4, "tokens": 16384, "chunk": 8192, "chunk_rows": [8192, 8192],
           "vs_base": "the oneshot_wht6 off arm"}
    records = [dict(timed_record("off", "sdma", 200.0, ar_share=0.5), vs_base=1.2),
               dict(timed_record("on", "sdma", 160.0, speedup=1.25), vs_base=1.5)]
    left = prefill_report.figure(hdr, records).axes[0]
    assert [t.get_text() for t in left.texts] == ["1.200x base", "1.250x\n1.500x base"]
    assert "vs the oneshot_wht6 off arm" in left.get_title()

# ----------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_emulated_world_verifies_and_times_every_backend():
    spec = prefill_measure.Spec(TINY, layers=2, chunk_rows=(256, 128), reps=3, warmup=2,
                                backends=tuple(backends.names()))
    records = prefill_emulated.emulated_run(spec, torch.device("cuda", 0), log=lambda s: None)
    ran = [r for r in records if "skipped" not in r]
    assert {r["backend"] for r in ran} >= {"sdma", "sdma_wht6", "oneshot_wht6"}
    for r in ran:
        assert r["correct"], r
        assert r["t_prefill_ms"] > 0 and r["tokens_per_s"] > 0
        assert sum(r[f"t_{c}_ms"] for c in prefill_stack.COMPONENTS) == \
            pytest.approx(r["t_prefill_ms"], rel=0.05)
        assert (r["ar_share"] > 0) if r["arm"] == "off" else (r["speedup"] > 0)
        if r["arm"] == "on":  # the bound hides at most each call's GEMM: never above off
            assert 1.0 <= r["speedup_bound"] and r["efficiency"] > 0
