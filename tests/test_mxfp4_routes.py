"""The ``mxfp4_w4a8`` producer's fast parts: the one-pass per-token quantize kernel (the
reference quantizer's bits), the fp8 route's plan (which weights widen exactly to e4m3,
CPU), the widening kernel (exact, Triton's interpreter), and on one GPU the route end to
end against the float64 product of the dequantized operands.

The independent facts: e4m3 holds m * 2^e exactly for a 1-bit mantissa m and e in
[-9, 7] (magnitudes 2^-9 .. 448); e2m1 values times 2^t (t in [-8, 6]) are such; the
reference product is :func:`radiance_ar.overlap.producer_mxfp4.reference` in float64.
"""

import importlib.util
import warnings

import pytest
import torch

from interpreter import run_under_interpreter
from radiance_ar.overlap import mxfp4_fp8_plan as fp8_plan
from radiance_ar.overlap import producer_mxfp4 as mx

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _edge_weight(spans: list[int], groups: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and scales, one row per span: block 0 at scale byte 140 holding every
    code 0..15 (twice), block 1 at 140 - span holding every code, the rest all-zero codes
    at scale byte 0 (as the quantizer leaves an all-zero block)."""
    n = len(spans)
    codes = torch.zeros(n, 32 * groups, dtype=torch.uint8)
    codes[:, :32] = torch.arange(32) % 16
    codes[:, 32:64] = (torch.arange(32) * 7) % 16
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scales = torch.zeros(n, groups, dtype=torch.uint8)
    scales[:, 0] = 140
    scales[:, 1] = torch.tensor([140 - s for s in spans], dtype=torch.uint8)
    return packed, scales


def test_plan_channel_exponents_and_the_e4m3_range():
    packed, scales = _edge_weight([0, 14, 15, 14])
    scales[3, 2] = 255  # a NaN scale on a zero-code block still poisons the channel
    plan = fp8_plan.make_plan(packed, scales)
    assert plan.channel_exp.tolist() == [140 - 133] * 4  # the top block widens to t = 6
    assert plan.channel_scale.double().tolist() == [[2.0 ** 7] * 4]
    assert plan.misfits == 2  # the span of 15 and the NaN


def test_plan_ignores_zero_blocks_and_needs_a_normal_channel_scale():
    packed, scales = _edge_weight([3, 3, 3])
    packed[1] = 0  # an all-zero row: exponent 0, fits
    scales[2, :2] = torch.tensor([6, 3], dtype=torch.uint8)  # 2^(6 - 133) is not normal fp32
    plan = fp8_plan.make_plan(packed, scales)
    assert plan.channel_exp.tolist() == [7, 0, 6 - 133]
    assert plan.misfits == 1


def test_plan_of_a_quantized_weight_fits():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) / 16
    w[5, 64:96] = 0.0  # an all-zero block: scale byte 0, ignored
    packed, scales = mx.quantize_weight(w)
    assert scales[5, 2] == 0
    assert fp8_plan.make_plan(packed, scales).misfits == 0


def test_cached_plan_is_remade_when_the_weight_is_rewritten():
    packed, scales = _edge_weight([2, 2])
    first = fp8_plan.cached_plan(packed, scales)
    assert fp8_plan.cached_plan(packed, scales) is first
    scales[0, 0] = 150  # in place: the version counter moves
    again = fp8_plan.cached_plan(packed, scales)
    assert again is not first and again.channel_exp.tolist() == [150 - 133, 140 - 133]
    scales[1, 1] = 100  # a span of 40 with non-zero codes
    with pytest.warns(UserWarning, match="1 of 2 output channels .* Triton route"):
        assert fp8_plan.cached_plan(packed, scales).misfits == 1


def test_route_is_not_offered_off_hopper_or_below_its_rows():
    cpu = torch.device("cpu")
    assert not fp8_plan.available(cpu, torch.bfloat16, 8192, 5120)


WIDEN_SCRIPT = r"""
import torch
from radiance_ar.overlap import mxfp4_fp8_plan as fp8_plan, producer_mxfp4 as mx
from radiance_ar.overlap.kernels import mxfp4_widen_fp8 as widen
import sys
sys.path.insert(0, "tests")
import test_mxfp4_fp8 as t
packed, scales = t._edge_weight([0, 1, 7, 14, 14, 0, 3], groups=20)  # K = 640: 2 K tiles
scales[5, :2] = 254  # the top of the e8m0 range
plan = fp8_plan.make_plan(packed, scales)
assert plan.misfits == 0
out = torch.full((7, 640), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
widen.widen(packed, scales, plan.channel_exp, out=out)
got = out.double() * torch.pow(2.0, plan.channel_exp.double())[:, None]
assert torch.equal(got, mx.dequantize_weight(packed, scales)), "the widening is not exact"
# every code at both range ends: 6 * 2^6 = 384 and 0.5 * 2^-8 = 2^-9 (e4m3's smallest)
assert out[3].float().abs().max() == 384 and out[3, 32:64].float().abs().min() == 0
assert sorted(set(out[3, 32:64].float().abs().tolist()))[1] == 2.0 ** -9
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_widening_is_exact_under_the_interpreter():
    run_under_interpreter(WIDEN_SCRIPT)


QUANTIZE_SCRIPT = r"""
import torch
from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap.kernels import fp8_per_token as q
torch.manual_seed(0)
# one pass (K = 160, 2048) and two (K = 9000); bf16, fp32, fp16; rows of magnitudes 1e-6 ..
# 1e3 (fp16: subnormal inputs, and -0 from underflow), and an all-zero row
for rows, k, dtype in ((37, 160, torch.bfloat16), (5, 9000, torch.bfloat16),
                       (9, 2048, torch.float32), (3, 96, torch.float16)):
    x = (torch.randn(rows, k) * torch.logspace(-6, 3, rows)[:, None]).to(dtype)
    x[1] = 0
    ref_q, ref_s = mx.quantize_activation(x)
    for store in (torch.float8_e4m3fn, torch.bfloat16):
        out = torch.full((rows, k), float("nan")).to(store)
        scale = torch.full((rows,), float("nan"))
        got_q, got_s = q.quantize(x, out=out, scale=scale)
        assert torch.equal(got_s.view(torch.int32), ref_s.view(torch.int32)), (rows, k, dtype)
        want = ref_q if store == torch.float8_e4m3fn else ref_q.to(torch.bfloat16)
        assert torch.equal(got_q.view(torch.uint8 if store != torch.bfloat16 else torch.int16),
                           want.view(torch.uint8 if store != torch.bfloat16 else torch.int16)), \
            (rows, k, dtype, store)
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_quantize_kernel_has_the_reference_bits_under_the_interpreter():
    run_under_interpreter(QUANTIZE_SCRIPT)


# ---------------------------------------------------------------------------- one GPU

@pytest.mark.gpu
@pytest.mark.parametrize("rows,k,dtype", [(8192, 4352, torch.bfloat16), (333, 9000, torch.bfloat16),
                                          (1000, 2048, torch.float16)])
def test_gpu_quantize_kernel_has_the_reference_bits(rows, k, dtype):
    from radiance_ar.overlap.kernels import fp8_per_token
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-4, 3, rows)[:, None]).to(dtype).cuda()
    x[7] = 0
    ref_q, ref_s = mx.quantize_activation(x)
    out = torch.full((rows, k), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    got_q, got_s = fp8_per_token.quantize(x, out=out)
    assert torch.equal(got_s, ref_s)
    assert torch.equal(got_q.view(torch.uint8), ref_q.view(torch.uint8))


#: |fp8 route - float64| <= 2^-8 |ref| (bf16 output) + this * sum |terms|: the fp8 GEMM
#: accumulates exact products; Hopper's fp8 MMA keeps fewer bits than fp32 inside one
#: instruction (docs: about 14), which this allows 4x over
ACCUMULATION_BOUND = 2 ** -12


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the fp8 route runs on Hopper")
def test_gpu_fp8_route_matches_float64_with_blocks_at_the_range_edges():
    from radiance_ar.overlap import producers
    from radiance_ar.overlap.scratch import ScratchPool
    rows, n, k = 4096, 5120, 4352
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=g) / k ** 0.5)
    # per channel, one block 2^14 below the channel's largest (the widest span that fits)
    w[:, 64:96] *= 2.0 ** -14
    w[:, 96:128] = 0.0
    packed, scales = mx.quantize_weight(w.to(torch.bfloat16).cuda())
    prod = producers.get(mx.NAME)
    p = prod.prepare(x, packed, scales, ScratchPool())
    assert p.weight.dtype == torch.float8_e4m3fn, "the fp8 route was not taken"
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    for a, b in ((0, 1024), (1024, 2048), (2048, 4096)):  # slices, 16-row aligned
        prod.launch(p, a, b, out[a:b], torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all()), "an element was not written"
    ref = mx.reference(p.x, p.x_scale, packed, scales)
    mag = mx.dequantize_activation(p.x, p.x_scale).abs() @ mx.dequantize_weight(
        packed, scales).abs().t()
    got = out.double()
    assert float((got - ref).norm() / ref.norm()) < 2 ** -8
    excess = ((got - ref).abs() - 2 ** -8 * ref.abs()).clamp_min(0) / mag
    assert float(excess.max()) <= ACCUMULATION_BOUND, float(excess.max())


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the fp8 route runs on Hopper")
def test_gpu_routes_small_calls_and_misfit_weights_to_triton():
    from radiance_ar.overlap import producers
    from radiance_ar.overlap.scratch import ScratchPool
    prod = producers.get(mx.NAME)
    w = torch.randn(256, 512).cuda() / 20
    packed, scales = mx.quantize_weight(w)
    small = torch.randn(fp8_plan.MIN_ROWS - 1, 512, device="cuda").to(torch.bfloat16)
    assert prod.prepare(small, packed, scales, ScratchPool()).weight.dtype == torch.uint8
    big = torch.randn(fp8_plan.MIN_ROWS, 512, device="cuda").to(torch.bfloat16)
    assert prod.prepare(big, packed, scales, ScratchPool()).weight.dtype == torch.float8_e4m3fn
    scales[3, 1] = max(int(scales[3, 0]) - 20, 0)  # a span of 20 with non-zero codes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = prod.prepare(big, packed, scales, ScratchPool())
    assert p.weight.dtype == torch.uint8 and "Triton route" in str(caught[0].message)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the fp8 route runs on Hopper")
def test_gpu_capture_refuses_an_unplanned_weight(monkeypatch):
    packed, scales = mx.quantize_weight(torch.randn(256, 512).cuda())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="one eager call"):
        fp8_plan.cached_plan(packed, scales)
