"""The ``mxfp4_w4a8`` producer's routes (radiance_ar/overlap/mxfp4_routes.py): the weight
widened to e4m3 in memory (exact, Triton's interpreter), the per-weight column plan's
cache, and on one GPU the routes end to end against the float64 product of the
dequantized operands, and which route a call takes.

Independent facts: e4m3 holds m * 2^e exactly for a 1-bit mantissa m and e in [-9, 7]
(magnitudes 2^-9 .. 448), so e2m1 values times 2^E (E in [-8, 6]) are such; the
reference product is :func:`radiance_ar.overlap.producer_mxfp4.reference` in float64.
"""

import importlib.util
import warnings

import pytest
import torch

from interpreter import run_under_interpreter
from radiance_ar.overlap import mxfp4_routes as routes
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


def test_cached_plan_is_remade_when_the_weight_is_rewritten():
    packed, scales = _edge_weight([2, 2])
    first = routes.cached_plan(packed, scales)
    assert routes.cached_plan(packed, scales) is first
    scales[0, 0] = 150  # in place: the version counter moves
    again = routes.cached_plan(packed, scales)
    assert again is not first and again.top.tolist() == [150, 140]
    assert again.top.data_ptr() == first.top.data_ptr()  # the old plan's tensors, rewritten
    assert again.col_scale.tolist() == [2.0 ** (150 - 133), 2.0 ** (140 - 133)]
    packed[0, 40:48] = 0  # the codes too (an in-place write, same values)
    assert routes.cached_plan(packed, scales) is not again
    scales[1, 1] = 100  # a span of 40 binades with non-zero codes
    with pytest.warns(UserWarning, match="not exact in e4m3 .* bf16-widening"):
        assert not routes.cached_plan(packed, scales).fits
    with pytest.warns(UserWarning, match="not exact in e4m3"):  # new codes: planned again
        routes.cached_plan(packed.clone(), scales)


def test_a_rewrite_through_data_needs_forget_plans():
    packed, scales = _edge_weight([2, 2])
    first = routes.cached_plan(packed, scales)
    scales.data.copy_(scales.data + 1)  # as a weight loader writes: no version counter moves
    assert routes.cached_plan(packed, scales) is first  # stale: what forget_plans is for
    old = first.top.tolist()
    routes.forget_plans()
    again = routes.cached_plan(packed, scales)
    assert again is not first and again.top.tolist() == [t + 1 for t in old]
    # into the old plan's tensors, whose addresses a graph captured before holds
    assert again.top.data_ptr() == first.top.data_ptr()


def test_cublas_route_takes_fewer_rows_for_longer_rows():
    assert [routes.cublas_min_rows(k) for k in (512, 2048, 2080, 4352, 28672)] == [
        8192, 8192, 2048, 2048, 2048]


def test_cublas_route_refusals_name_their_reason():
    cpu = torch.device("cpu")
    assert "not an NVIDIA GPU" in routes.cublas_refusal(cpu, torch.bfloat16, 8192, 5120, 4352)


WIDEN_SCRIPT = r"""
import torch
from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fk
from radiance_ar.overlap.kernels import mxfp4_widen_fp8 as widen
import sys
sys.path.insert(0, "tests")
import test_mxfp4_routes as t
packed, scales = t._edge_weight([0, 1, 7, 14, 14, 0, 3], groups=20)  # K = 640: 2 K tiles
scales[5, :2] = 254  # the top of the e8m0 range
plan = fk.plan_columns(packed, scales)
assert plan.fits
out = torch.full((7, 640), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
widen.widen(packed, scales, plan.top, out=out)
got = out.double() * plan.col_scale.double()[:, None]
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


EVERY_CODE_SCRIPT = r"""
import torch
from radiance_ar.overlap import producer_mxfp4 as mx
from radiance_ar.overlap.kernels import mxfp4_widen_fp8 as widen
# every code 0..15 (twice a group) at every exponent E = -8..6 the kernel can meet: one
# group per E (scale byte 121 + E against top 127: E = scale - top + 6), both nibbles
codes = torch.arange(32) % 16
rows = torch.stack([codes, codes.flip(0)])  # a code in the low and in the high nibble
k = 32 * 15
full = rows.repeat(1, 15)
packed = (full[:, 0::2] | (full[:, 1::2] << 4)).to(torch.uint8)
scales = (torch.arange(15) + 113).to(torch.uint8).repeat(2, 1)  # E = -8 .. 6
top = torch.full((2,), 127, dtype=torch.int32)
out = torch.full((2, k), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
widen.widen(packed, scales, top, out=out)
table = torch.tensor(mx.E2M1_VALUES, dtype=torch.float64)
value = table[full % 8] * torch.where(full >= 8, -1.0, 1.0).double()
e = (torch.arange(15) - 8).repeat_interleave(32).double()
want = (value * torch.pow(2.0, e)).to(torch.float8_e4m3fn)
bad = (out.view(torch.uint8) != want.view(torch.uint8)).nonzero()
assert bad.numel() == 0, [(tuple(b), out[tuple(b)].item(), want[tuple(b)].item()) for b in bad[:6].tolist()]
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_widening_bytes_of_every_code_at_every_exponent_under_the_interpreter():
    """Against torch's cast of the exact value (an independent encoder), -0 included."""
    run_under_interpreter(EVERY_CODE_SCRIPT)


PREPARE_SCRIPT = r"""
import sys
import torch
from radiance_ar.overlap import mxfp4_routes as routes, producer_mxfp4 as mx, producers
from radiance_ar.overlap.scratch import ScratchPool
sys.path.insert(0, "tests")
import test_mxfp4_routes as t
routes.cublas_refusal = lambda *args: ""  # this GPU-only route, on the CPU's _scaled_mm
torch.manual_seed(0)
rows, k = 40, 96
x = torch.randn(rows, k).to(torch.bfloat16)
# random channels, and channels at e4m3's range edges (spans 0, 7, 14: E = 6 .. -8)
edge_packed, edge_scales = t._edge_weight([0, 7, 14, 14], groups=3)
packed, scales = mx.quantize_weight(torch.randn(44, k) / 10)
packed, scales = torch.cat([packed, edge_packed]), torch.cat([scales, edge_scales])
p = producers.get(mx.NAME).prepare(x, packed, scales, ScratchPool())
assert p.route == "cublas_fp8" and p.weight.shape == (48, k) and p.weight_scale.shape == (1, 48)
xq, xs = mx.quantize_activation(x)
assert torch.equal(p.x.view(torch.uint8), xq.view(torch.uint8))
assert p.x_scale.shape == (x.shape[0], 1) and torch.equal(p.x_scale.reshape(-1), xs)
# what torch._scaled_mm rowwise multiplies: (x_scale * xq) @ (w8 * col_scale).T
w = p.weight.double() * p.weight_scale.double().t()
assert torch.equal(w, mx.dequantize_weight(packed, scales))
# and the route's product, in two row slices, against float64
out = torch.full((rows, 48), float("nan"), dtype=torch.bfloat16)
for a, b in ((0, 16), (16, rows)):
    producers.get(mx.NAME).launch(p, a, b, out[a:b], 0)
ref = mx.reference(xq, xs, packed, scales)
mag = mx.dequantize_activation(xq, xs).abs() @ mx.dequantize_weight(packed, scales).abs().t()
err = (out.double() - ref).abs()
assert bool(torch.isfinite(out).all()), "an element was not written"
assert bool((err <= 2 ** -8 * ref.abs() + (k + 4) * 2 ** -24 * mag).all()), float(
    ((err - 2 ** -8 * ref.abs()) / mag).max())
assert float((out.double() - ref).norm() / ref.norm()) < 2 ** -8
print("interpreter-ok")
"""


@pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_cublas_route_is_exact_against_float64_under_the_interpreter():
    run_under_interpreter(PREPARE_SCRIPT)


# ---------------------------------------------------------------------------- one GPU

#: |cublas_fp8 route - float64| <= 2^-8 |ref| (bf16 output) + this * sum |terms|. The
#: products are exact; torch's rowwise fp8 GEMM (fast accumulation off) adds them on
#: Hopper's fp8 MMA, which keeps fewer bits than fp32 between its promotions to fp32
#: (DeepSeek-V3 report: about 14), so this is a loose guard against gross error.
ACCUMULATION_BOUND = 2 ** -10
#: The RMS error may exceed that of rounding the float64 product to bf16 by this factor
#: (the issue's target: no worse than today's Triton kernel, whose 1.7e-3 on the bench
#: data is that rounding alone: every config measured 0.001660, tools/results/
#: 2026-12-03-h200-mxfp4/bench_mxfp4.json).
RMS_OVER_ROUNDING = 1.05


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_widening_bits_are_the_weight_over_its_column_scales():
    """The widening kernel on the GPU against torch's cast of the float64 weight divided
    by the column scales (exact values: the cast only encodes them), at the bench's
    shape (K = 4352: a masked K tile) with channels at the range edges."""
    from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fk
    from radiance_ar.overlap.kernels import mxfp4_widen_fp8 as widen
    packed, scales = _bench_weight_with_edges(512, 4352)
    plan = fk.plan_columns(packed, scales)
    assert plan.fits
    want = (mx.dequantize_weight(packed, scales) / plan.col_scale.double()[:, None])
    assert bool((want.abs() <= 448).all())
    want = want.to(torch.float8_e4m3fn)
    got = torch.full((512, 4352), 0x7F, dtype=torch.uint8, device="cuda").view(want.dtype)
    widen.widen(packed, scales, plan.top, out=got)
    torch.cuda.synchronize()
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} of {got.numel()} bytes differ, first at "
                              f"{bad[:4].tolist()}: got {got[tuple(bad[0])].item()}, "
                              f"want {want[tuple(bad[0])].item()}")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the fp8 route runs on Hopper")
def test_gpu_scaled_mm_of_the_reference_widening_matches_float64():
    """torch's rowwise fp8 GEMM, alone, on the reference widening (torch's own cast) and
    power-of-two column scales, against float64: with the test above it says whether
    the route's widening or the GEMM is wrong."""
    packed, scales = _bench_weight_with_edges(512, 4352)
    from radiance_ar.overlap.kernels import mxfp4_fp8_gemm as fk
    plan = fk.plan_columns(packed, scales)
    w8 = (mx.dequantize_weight(packed, scales) / plan.col_scale.double()[:, None]).to(
        torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(6)
    xq, xs = mx.quantize_activation(torch.randn(1024, 4352, generator=g).cuda())
    out = torch.full((1024, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch._scaled_mm(xq, w8.t(), scale_a=xs[:, None], scale_b=plan.col_scale.reshape(1, -1),
                     out_dtype=torch.bfloat16, out=out)
    _assert_within_bound(out, xq, xs, packed, scales)


def _bench_weight_with_edges(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bench's weight (randn / sqrt(K)) quantized on the GPU, its first channels
    replaced by :func:`_edge_weight`'s (spans 0, 1, 7, 14: E = 6 down to -8)."""
    g = torch.Generator().manual_seed(4)
    packed, scales = mx.quantize_weight((torch.randn(n, k, generator=g) / k ** 0.5).cuda())
    edge_packed, edge_scales = _edge_weight([0, 1, 7, 14], groups=k // 32)
    packed[:4], scales[:4] = edge_packed.cuda(), edge_scales.cuda()
    return packed, scales


def _assert_within_bound(out, xq, xs, packed, scales) -> None:
    assert bool(torch.isfinite(out).all()), "an element was not written"
    ref = mx.reference(xq, xs, packed, scales)
    mag = mx.dequantize_activation(xq, xs).abs() @ mx.dequantize_weight(
        packed, scales).abs().t()
    got = out.double()
    rms = float((got - ref).norm() / ref.norm())
    rounding = float((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm())
    assert rms <= RMS_OVER_ROUNDING * rounding, (rms, rounding)
    excess = ((got - ref).abs() - 2 ** -8 * ref.abs()).clamp_min(0) / mag
    assert float(excess.max()) <= ACCUMULATION_BOUND, float(excess.max())


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the fp8 route runs on Hopper")
def test_gpu_fp8_route_matches_float64_with_blocks_at_the_range_edges():
    from radiance_ar.overlap import producers
    from radiance_ar.overlap.scratch import ScratchPool
    rows, n, k = 4096, 5120, 4352
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(n, k, generator=g) / k ** 0.5
    # Per channel, block 0 the largest (16x: its scale is the channel's top), block 2 the
    # same values times 2^-14 (its scale byte exactly 14 below: the widest span that
    # fits, every code at E = -8 .. 6), block 3 all zero (scale byte 0, ignored).
    w[:, :32] *= 16
    w[:, 64:96] = w[:, :32] * 2.0 ** -14
    w[:, 96:128] = 0.0
    packed, scales = mx.quantize_weight(w.to(torch.bfloat16).cuda())
    prod = producers.get(mx.NAME)
    p = prod.prepare(x, packed, scales, ScratchPool())
    assert p.route == "cublas_fp8" and p.weight.dtype == torch.float8_e4m3fn
    assert bool((scales[:, 0].int() - scales[:, 2].int() == 14).all())
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    for a, b in ((0, 1024), (1024, 2048), (2048, 4096)):  # slices, 16-row aligned
        prod.launch(p, a, b, out[a:b], torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    _assert_within_bound(out, p.x, p.x_scale, packed, scales)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the fp8 route runs on Hopper")
def test_gpu_routes_by_rows_and_by_plan():
    from radiance_ar.overlap import producers
    from radiance_ar.overlap.scratch import ScratchPool
    prod = producers.get(mx.NAME)
    w = torch.randn(256, 512).cuda() / 20
    packed, scales = mx.quantize_weight(w)
    least = routes.cublas_min_rows(512)
    small = torch.randn(least - 1, 512, device="cuda").to(torch.bfloat16)
    big = torch.randn(least, 512, device="cuda").to(torch.bfloat16)
    for x, route in ((small, "triton_fp8"),
                     (big, "cublas_fp8")):
        p = prod.prepare(x, packed, scales, ScratchPool())
        out = torch.full((x.shape[0], 256), float("nan"), dtype=torch.bfloat16, device="cuda")
        prod.launch(p, 0, x.shape[0], out, torch.cuda.current_stream().cuda_stream)
        ref = mx.reference(p.x, p.x_scale, packed, scales)
        assert p.route == route
        assert float((out.double() - ref).norm() / ref.norm()) < 2 ** -8, route
    scales[3, 1] = max(int(scales[3, 0]) - 20, 0)  # a span of 20 binades, non-zero codes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = prod.prepare(big, packed, scales, ScratchPool())
    assert p.route == "triton_bf16" and "not exact in e4m3" in str(caught[0].message)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the fp8 route runs on Hopper")
def test_gpu_capture_refuses_an_unplanned_weight(monkeypatch):
    packed, scales = mx.quantize_weight(torch.randn(256, 512).cuda())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="one eager call"):
        routes.cached_plan(packed, scales)
