"""The ``mxfp4_w4a8`` producer: its formats and quantizers against the OCP MX spec (CPU),
the Triton kernel against the float64 product of the dequantized operands (Triton's
interpreter on the CPU; a GPU at a prefill shape), and the refusals of its wrapper.

Spec facts used as the independent reference: e2m1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4,
6} for codes 0..7 with bit 3 the sign, two codes per byte with the first element in the
low nibble; an e8m0 byte e is 2^(e - 127) and 255 is NaN; a block's shared exponent is
floor(log2(max |w|)) - 2, its elements rounded to nearest (ties to even) and saturated.
"""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from interpreter import ROOT, run_under_interpreter
from mxfp4_data import gpu_operands
from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap import producers
from radiance_ar.overlap.kernels import mxfp4_w4a8 as kernel
from radiance_ar.overlap.scratch import ScratchPool

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def brute_force_e2m1(w: torch.Tensor) -> torch.Tensor:
    """float64 values the spec's conversion gives for w [N, K], element by element."""
    out = torch.empty(w.shape, dtype=torch.float64)
    for n in range(w.shape[0]):
        for b in range(w.shape[1] // 32):
            block = [float(v) for v in w[n, 32 * b:32 * (b + 1)]]
            amax = max(abs(v) for v in block)
            exp = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax else -127
            for i, v in enumerate(block):
                mag = min(abs(v) / 2.0 ** exp, 6.0)
                # nearest grid value; on a tie the even code (its index) wins
                code = min(range(8), key=lambda c: (abs(GRID[c] - mag), c % 2))
                out[n, 32 * b + i] = math.copysign(GRID[code], v) * 2.0 ** exp
    return out


def test_codes_and_packing_follow_the_spec():
    row = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    w = torch.tensor([row + [0.0] * 16], dtype=torch.float32)  # max 6: shared exponent 0
    packed, scales = mx.quantize_weight(w)
    assert scales.tolist() == [[127]]
    codes = list(range(8)) + [0] + list(range(9, 16))  # -0 is stored as +0
    want = [codes[2 * j] | codes[2 * j + 1] << 4 for j in range(8)] + [0] * 8
    assert packed.tolist() == [want]
    assert mx.dequantize_weight(packed, scales).tolist() == [[abs(v) if v == 0 else v for v in row]
                                                            + [0.0] * 16]


def test_quantize_weight_matches_the_spec_element_by_element():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 128, generator=g)
    w[1] *= 1e-3
    w[2, 5] = 40.0  # an outlier sets its block's scale
    w[3, 32:64] = 0.0  # an all-zero block
    # exact ties at 2^0 * the midpoints (block max 6 -> shared exponent 0)
    w[4, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    w[5, :32] = 7.5  # above 6 * 2^X: saturates at 6 (floor(log2 7.5) - 2 = 0)
    packed, scales = mx.quantize_weight(w)
    got = mx.dequantize_weight(packed, scales)
    assert torch.equal(got, brute_force_e2m1(w))
    assert got[4, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert got[5, 0] == 6.0 and scales[5, 0] == 127


def test_dequantize_special_scales():
    packed = torch.full((3, 16), 0x72, dtype=torch.uint8)  # codes 2 (1.0) and 7 (6.0)
    scales = torch.tensor([[0], [254], [255]], dtype=torch.uint8)
    w = mx.dequantize_weight(packed, scales)
    assert w[0, :2].tolist() == [2.0 ** -127, 6 * 2.0 ** -127]
    assert w[1, :2].tolist() == [2.0 ** 127, 6 * 2.0 ** 127]
    assert bool(w[2].isnan().all())


def test_quantize_activation_per_token():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    x[3] = 0.0
    xq, scale = mx.quantize_activation(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (5,)
    assert xq.float()[[0, 1, 2, 4]].abs().amax(dim=1).tolist() == [448.0] * 4
    assert not bool(xq.float()[3].any())
    # the scale is the quotient rounded once to fp32 (the float64 quotient of fp32 values
    # rounded to fp32 is that: 53 >= 2 * 24 + 2 bits), not amax times a rounded 1/448
    want = (x.double().abs().amax(dim=1) / 448).float().clamp_min(1e-12)
    assert torch.equal(scale, want)
    back = mx.dequantize_activation(xq, scale)
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, or 2^-10 * scale
    # below the normal range
    bound = torch.maximum(x.double().abs() * 2 ** -4, scale.double()[:, None] * 2 ** -10)
    assert bool(((back - x.double()).abs() <= bound * (1 + 1e-6)).all())


def test_producer_is_registered_and_checks_its_weight():
    assert mx.NAME in producers.names()
    x = torch.randn(4, 64)
    packed, scales = mx.quantize_weight(torch.randn(8, 64))
    prod = producers.get(mx.NAME)
    with pytest.raises(ValueError, match=r"weight must be .* \(N, 32\)"):
        prod.prepare(x, packed[:, :16], scales, ScratchPool())
    with pytest.raises(ValueError, match=r"weight_scale must be .* \(8, 2\).* got None"):
        prod.prepare(x, packed, None, ScratchPool())
    with pytest.raises(ValueError, match="K = 48 must be a multiple of 32"):
        prod.prepare(torch.randn(4, 48), packed[:, :24], scales, ScratchPool())
    p = prod.prepare(x, packed, scales, ScratchPool())
    assert p.x.dtype == torch.float8_e4m3fn and p.x_scale.shape == (4,)


def _kernel_args():
    x = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    return dict(x=x, x_scale=torch.ones(4), w=torch.zeros(8, 32, dtype=torch.uint8),
                w_scale=torch.zeros(8, 2, dtype=torch.uint8))


@pytest.mark.parametrize("change,message", [
    (dict(x=torch.zeros(4, 64)), "x must be 2-D"),
    (dict(x=torch.zeros(4, 48, dtype=torch.float8_e4m3fn)), "K = 48"),
    (dict(x_scale=torch.ones(4, 1)), r"x_scale must be contiguous float32 of shape \(4,\)"),
    (dict(w=torch.zeros(8, 64, dtype=torch.uint8)), r"w must be packed e2m1 uint8 of shape \(N, 32\)"),
    (dict(w_scale=torch.zeros(8, 4, dtype=torch.uint8)), r"w_scale must be e8m0 uint8 of shape \(8, 2\)"),
    (dict(out=torch.zeros(4, 8, dtype=torch.int32)), r"out must be \(4, 8\)"),
    (dict(x_scale=[1.0] * 4), "x_scale must be a torch.Tensor"),
    ({}, "kernel runs on CUDA/ROCm GPUs"),
])
def test_wrapper_refuses_bad_input_naming_it(change, message, monkeypatch):
    # The checks run before Triton is imported; the interpreter lets CPU tensors past the
    # device check, except in the case that tests that check.
    if change:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _kernel_args()
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        kernel.mxfp4_w4a8_gemm(**args)


def test_overlap_imports_without_triton():
    script = ("import sys; sys.modules['triton'] = None\n"
              "import torch\n"
              "from radiance_ar.overlap import producers, producer_mxfp4 as mx\n"
              "assert mx.NAME in producers.names()\n"
              "try:\n"
              "    mx.kernel._kernel()\n"
              "except RuntimeError as e:\n"
              "    assert 'needs Triton' in str(e), e\n"
              "else:\n"
              "    raise AssertionError('no error without Triton')\n"
              "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


INTERPRETER_SCRIPT = r"""
import torch
from radiance_ar.overlap import producer_mxfp4 as mx, producers
from radiance_ar.overlap.kernels import mxfp4_w4a8 as K
from radiance_ar.overlap.scratch import ScratchPool
C = K.LaunchConfig
torch.manual_seed(0)
for rows, n, k in ((37, 72, 192), (5, 40, 160)):  # tails in M and N; K = 160: a masked step
    x = torch.randn(rows, k)
    w = torch.randn(n, k) * torch.logspace(-3, 3, n)[:, None]  # per-row scales far apart
    packed, scales = mx.quantize_weight(w)
    scales[1, 0] = 0  # the extremes of the e8m0 range the paths cover
    scales[2, -1] = 240
    xq, xs = mx.quantize_activation(x)
    ref = mx.reference(xq, xs, packed, scales)
    mag = mx.dequantize_activation(xq, xs).abs() @ mx.dequantize_weight(packed, scales).abs().t()
    for cfg in (C(32, 32, 64, 2, False, False, 4, 1), C(16, 32, 64, 2, True, False, 4, 1),
                C(32, 32, 64, 2, True, True, 4, 1), C(16, 16, 128, 1, False, True, 4, 1),
                C(16, 32, 32, 1, True, True, 4, 1)):
        for xin in (xq, xq.to(torch.bfloat16)):
            out = K.mxfp4_w4a8_gemm(xin, xs, packed, scales, out=torch.empty(rows, n), config=cfg)
            # fp32 sums of exact products: within a few fp32 roundings of sum |terms|
            assert bool(((out.double() - ref).abs() <= 1e-5 * mag).all()), (rows, n, k, cfg)
    # bf16 into a view with a longer row stride, inside a NaN-poisoned buffer
    buf = torch.full((rows + 2, n + 8), float("nan"), dtype=torch.bfloat16)
    view = buf[1:rows + 1, :n]
    K.mxfp4_w4a8_gemm(xq, xs, packed, scales, out=view, config=C(16, 32, 64, 2, True, True, 4, 1))
    # the interpreter truncates fp32 to bf16 (the GPU rounds to nearest): one bf16 step
    assert bool(((view.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-5 * mag).all())
    assert bool(buf[0].isnan().all() and buf[-1].isnan().all() and buf[:, n:].isnan().all())
    # a NaN scale (byte 255) poisons the output channels that read it, and only those
    bad = scales.clone()
    bad[3, 1] = 255
    for cfg in (C(32, 32, 64, 2, False, False, 4, 1), C(32, 32, 64, 2, True, True, 4, 1)):
        out = K.mxfp4_w4a8_gemm(xq, xs, packed, bad, out=torch.empty(rows, n), config=cfg)
        assert bool(out[:, 3].isnan().all())
        assert bool(torch.isfinite(out[:, [c for c in range(n) if c != 3]]).all())
# the producer: prepare once, launch row slices into views of one output
x = torch.randn(50, 96).to(torch.bfloat16)
packed, scales = mx.quantize_weight(torch.randn(64, 96))
prod = producers.get(mx.NAME)
p = prod.prepare(x, packed, scales, ScratchPool())
y = torch.full((50, 64), float("nan"))
for a, b in ((0, 17), (17, 40), (40, 50)):
    prod.launch(p, a, b, y[a:b], 0)
ref = mx.reference(p.x, p.x_scale, packed, scales)
assert float((y.double() - ref).norm() / ref.norm()) < 1e-6
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_matches_reference_under_the_interpreter():
    run_under_interpreter(INTERPRETER_SCRIPT)


OP_SCRIPT = r"""
import torch
from radiance_ar import overlap
from radiance_ar.transport.world import single_world
from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap.config import OverlapSettings
from radiance_ar.overlap.op import forward
torch.manual_seed(0)
x = torch.randn(50, 96).to(torch.bfloat16)
packed, scales = mx.quantize_weight(torch.randn(64, 96))
xq, xs = mx.quantize_activation(x)
ref = mx.reference(xq, xs, packed, scales)
for backend in ("stock", "sdma"):  # unsliced, and 3 slices
    rt = overlap.build(single_world(torch.device("cpu")), OverlapSettings(True, backend, 1, 3))
    out = forward(rt, x, packed, scales, mx.NAME)
    assert out.shape == (50, 64) and out.dtype == torch.bfloat16
    # the interpreter truncates fp32 to bf16: within one bf16 step
    assert float((out.double() - ref).norm() / ref.norm()) < 2 ** -7, backend
    rt.close()
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_op_runs_the_producer_with_its_packed_weight_under_the_interpreter():
    run_under_interpreter(OP_SCRIPT)


# ---------------------------------------------------------------------------- one GPU

def _gpu_operands(rows: int, n: int, k: int, seed: int = 0):
    _, xq, xs, packed, scales = gpu_operands(rows, n, k, seed)
    return xq, xs, packed, scales, mx.reference(xq, xs, packed, scales)


#: the table's row classes on this GPU, and both multiply paths at the prefill tile
GPU_CASES = ("small", "medium", "large", "dot_scaled", "dequant")


def _gpu_config(label: str) -> kernel.LaunchConfig:
    if label == "dot_scaled":
        return kernel.LaunchConfig(128, 128, 128, 8, False, False, 8, 3)
    if label == "dequant":
        return kernel.LaunchConfig(128, 128, 128, 8, True, True, 8, 3)
    device = torch.device("cuda", torch.cuda.current_device())
    return kernel.CONFIGS[(kernel.gpu_class(device), label)]


@pytest.mark.gpu
@pytest.mark.parametrize("label", GPU_CASES)
@pytest.mark.parametrize("x_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_gpu_kernel_writes_every_row_of_its_slice(label, x_dtype):
    cfg = _gpu_config(label)
    rows, n, k, a, b = 4096, 5120, 4352, 1024, 3072  # a prefill slice of one rank's down_proj
    xq, xs, packed, scales, ref = _gpu_operands(rows, n, k)
    buf = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    kernel.mxfp4_w4a8_gemm(xq[a:b].to(x_dtype), xs[a:b], packed, scales, out=buf[a:b],
                           stream=side.cuda_stream, config=cfg)
    side.synchronize()
    got, want = buf[a:b].double(), ref[a:b]
    assert bool(buf[:a].isnan().all()) and bool(buf[b:].isnan().all())
    assert bool(torch.isfinite(got).all()), "an element of the slice was not written"
    rel = float((got - want).norm() / want.norm())
    assert rel < 2 ** -8, (label, rel)  # bf16 output rounding: about 2^-9.5 RMS
    mag = (xq[a:b].double().abs() * xs[a:b, None].double()) @ mx.dequantize_weight(
        packed, scales).abs().t()
    assert bool(((got - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * mag).all()), label


@pytest.mark.gpu
def test_gpu_launch_runs_on_the_given_stream():
    xq, xs, packed, scales, ref = _gpu_operands(512, 1024, 1024)
    out = torch.full((512, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernel.mxfp4_w4a8_gemm(xq, xs, packed, scales, out=out)  # compile and load first
    out.fill_(float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock: the side stream is busy
    kernel.mxfp4_w4a8_gemm(xq, xs, packed, scales, out=out, stream=side.cuda_stream)
    torch.cuda.current_stream().synchronize()
    assert bool(out.isnan().all()), "the kernel ran on the current stream, not the given one"
    side.synchronize()
    assert float((out.double() - ref).norm() / ref.norm()) < 2 ** -8


def test_scale_spread_tool_reports_every_distribution_and_writes_json(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import mxfp4_scale_spread as tool

    out = tmp_path / "spread.json"
    assert tool.main(["--rows", "16", "--k", "256", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    names = [r["distribution"] for r in got["rows"]]
    assert names[0] == "gaussian" and len(names) == 7 and got["limit"] == 14
    # a Gaussian weight's channels span a few binades, far inside e4m3's range
    assert got["rows"][0]["max"] <= 4 and got["rows"][0]["over_limit"] == 0.0
    assert all(r["median"] <= r["p99_9"] <= r["max"] for r in got["rows"])
    assert "gaussian" in capsys.readouterr().out


def test_the_kernel_config_is_the_calls_not_each_slices(monkeypatch):
    """Chosen per slice, slices of another size class than the call took another config
    (another accumulation order): slicing changed the bits. prepare() chooses it once from
    the call's rows and every slice's launch passes it."""
    from radiance_ar.overlap.scratch import ScratchPool

    asked, launched = [], []
    monkeypatch.setattr(mx.kernel, "launch_config",
                        lambda device, rows: asked.append(rows) or f"config of {rows}")
    monkeypatch.setattr(mx.fp8_activation, "quantize_tokens",
                        lambda x, buf: (buf, torch.ones(x.shape[0])))
    monkeypatch.setattr(mx.kernel, "mxfp4_w4a8_gemm",
                        lambda *a, config=None, **k: launched.append(config))
    x = torch.randn(2048, 64).to(torch.bfloat16)
    packed, scales = mx.quantize_weight(torch.randn(32, 64).to(torch.bfloat16))
    p = mx.prepare(x, packed, scales, ScratchPool())
    assert p.route == "triton_bf16" and asked == [2048]
    for a, b in ((0, 128), (128, 400), (400, 2048)):  # slices of three size classes
        mx.launch(p, a, b, torch.empty(b - a, 32, dtype=torch.bfloat16), 0)
    assert asked == [2048] and launched == ["config of 2048"] * 3
