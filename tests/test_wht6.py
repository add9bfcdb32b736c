"""Tests of the wht6 codec (backends/wht6): the error bounds its format guarantees, its
special values, the issue-3 targets against the INT6 baseline, and the Triton kernels
against the torch reference (under the Triton interpreter on CPU, and on a GPU).

Error bounds come from the format, not from a run: with the compander u(t) = t(3+t)/4
and decision edges at t = k/31.5, a value in bin q is at most E_MAX * s_g from its level
(E_MAX is the largest level-to-edge distance in u, about 5/4 * 1/63), and the expected
squared error is the uniform-noise value sum (bin width * s_g)^2 / 12. The rotated
values are y = H32 x / 32 and x = H32 y, so a sub-block's decoded error norm is
sqrt(32) times its rotated one: at most 32 * E_MAX * s_g.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radiance_ar import wht6
from radiance_ar.wht6 import baseline_int6
from radiance_ar.wht6 import reference as ref

ROOT = Path(__file__).resolve().parents[1]


def _u(t):
    return t * (3 + t) / 4


_Q = torch.arange(32, dtype=torch.float64)
_EDGE_LO, _EDGE_HI = _u(_Q / 31.5), _u(torch.clamp((_Q + 1) / 31.5, max=1.0))
BIN_WIDTH = _EDGE_HI - _EDGE_LO  # width in u of the bin of each code magnitude
E_MAX = torch.maximum(_u((2 * _Q + 1) / 63) - _EDGE_LO, _EDGE_HI - _u((2 * _Q + 1) / 63)).max().item()
FP32_SLACK = 1e-5  # relative slack for fp32 rounding of scales, levels and rotations


def make(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """float64 test data: gaussian, student_t3, outlier_channels (0.5% x30), outlier_tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    if kind == "student_t3":
        x = x / torch.sqrt(torch.randn(rows, cols, 3, generator=g, dtype=torch.float64).square().sum(-1) / 3)
    elif kind == "outlier_channels":
        x[:, torch.randperm(cols, generator=g)[: max(1, cols // 200)]] *= 30.0
    elif kind == "outlier_tokens":
        x[torch.randperm(rows, generator=g)[: max(1, rows // 64)]] *= 50.0
    return x


def sub_scales(payload: torch.Tensor, cols: int) -> torch.Tensor:
    """float64 s_g of every sub-block, [rows, cols / 32], read back from a payload."""
    _, sub_code, scale_bits = ref.unpack(payload, cols)
    scale = (scale_bits.to(torch.int32) << 16).view(torch.float32).double()
    return scale.repeat_interleave(ref.GROUP, dim=1) * ref.sub_ratio(sub_code).double()


def rotated(x: torch.Tensor) -> torch.Tensor:
    """Exact rotated values y = H32 x / 32 (float64), [rows, cols / 32, 32]."""
    return ref.rotate(x.reshape(x.shape[0], -1, ref.SUB)) / ref.SUB


def rotated_error(x: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """Dequantized minus exact rotated values (float64), [rows, cols / 32, 32]."""
    return ref.dequantize(payload, x.shape[1]).double() - rotated(x)


def assert_within_format_bound(x: torch.Tensor, payload: torch.Tensor) -> None:
    """Every rotated value within E_MAX * s_g of the exact one (blocks sent as NaN are
    skipped: callers check which blocks those are)."""
    rows, cols = x.shape
    finite = sub_scales(payload, cols).isfinite()
    err = rotated_error(x, payload).abs()[finite]
    bound = (E_MAX * sub_scales(payload, cols)[..., None] * (1 + FP32_SLACK)).expand(rows, -1, 32)[finite]
    worst = (err - bound).max().item()
    assert worst <= 0, f"{(err > bound).sum().item()} values beyond the format bound (by {worst:.3g})"


# ---------------------------------------------------------------- format and layout

def test_bits_and_payload_shape():
    for cols in (256, 512, 4096, 5120, 8192):
        assert wht6.bits_per_value(cols) <= 6.25
        payload = wht6.encode(torch.zeros(3, cols))
        assert payload.shape == wht6.payload_shape(3, cols)
        assert 8 * payload.numel() / (3 * cols) == wht6.bits_per_value(cols)
    assert wht6.payload_shape(8192, 5120) == (8192, 4000)
    empty = wht6.encode(torch.zeros(0, 512))
    assert empty.shape == (0, 400) and wht6.decode(empty, (0, 512), torch.bfloat16).shape == (0, 512)
    assert baseline_int6.bits_per_value() == 6.5


def test_rotation_is_orthonormal():
    x = torch.randn(64, 32, dtype=torch.float32)
    y = ref.rotate(x)
    assert torch.equal((ref.rotate(y) / 32).to(torch.float32), x)  # exact in float64
    assert torch.allclose(y.square().sum(-1), 32 * x.double().square().sum(-1), rtol=1e-12)


@pytest.mark.parametrize("kind", ["gaussian", "student_t3", "outlier_channels", "outlier_tokens"])
def test_round_trip_within_format_bounds(kind):
    x = make(kind, 64, 2048).to(torch.float32)
    payload = wht6.encode(x)
    assert_within_format_bound(x, payload)
    # Per sub-block the error energy is 32x that of the rotated values (H / sqrt(32) is
    # orthonormal and x = H y), so the decoded error norm is at most 32 E_MAX s_g.
    err = (wht6.decode(payload, x.shape, torch.float32).double() - x.double()).reshape(64, -1, 32)
    assert (err.norm(dim=-1) <= ref.SUB * E_MAX * sub_scales(payload, 2048) * (1 + FP32_SLACK)).all()
    # Uniform-noise model of a fine quantizer: mean squared error = width^2 / 12 per value.
    code, _, _ = ref.unpack(payload, 2048)
    predicted = ((BIN_WIDTH[(code & 31).long()] * sub_scales(payload, 2048)[..., None]) ** 2 / 12).sum()
    measured = rotated_error(x, payload).square().sum()
    assert 0.9 < (measured / predicted).item() < 1.1


def test_codes_follow_the_format_rules_in_float64():
    """Scales and codes recomputed independently in float64 from the exact rotation."""
    x = make("student_t3", 32, 1024, seed=2).to(torch.float32)
    payload = wht6.encode(x)
    code, sub_code, scale_bits = ref.unpack(payload, 1024)
    y = rotated(x)
    sub_max = y.abs().amax(-1)
    # Block scale: the smallest bf16 at or above the block max.
    blk_max = sub_max.reshape(32, -1, ref.GROUP).amax(-1)
    scale = (scale_bits.to(torch.int32) << 16).view(torch.float32).double()
    below = ((scale_bits.to(torch.int32) - 1) << 16).view(torch.float32).double()
    assert (scale >= blk_max * (1 - FP32_SLACK)).all() and (below < blk_max * (1 + FP32_SLACK)).all()
    # Sub-block scale: the smallest (c/63)^2 * S at or above the sub-block max.
    s_blk = scale.repeat_interleave(ref.GROUP, 1)
    c = sub_code.double()
    assert (s_blk * (c / 63) ** 2 >= sub_max * (1 - FP32_SLACK)).all()
    assert (s_blk * ((c - 1) / 63) ** 2 < sub_max * (1 + FP32_SLACK))[c > 0].all()
    # Codes: sign, and floor(31.5 t) with t the inverse compander of |y| / s_g; a code
    # may differ only where 31.5 t sits within fp32 rounding of a decision edge.
    t = 2 * (torch.sqrt((y.abs() / sub_scales(payload, 1024)[..., None]).clamp(max=1) + 0.5625) - 0.75)
    expected = torch.floor(31.5 * t).clamp(0, 31)
    on_edge = (31.5 * t - torch.round(31.5 * t)).abs() < 1e-4
    assert ((code & 31).double() == expected)[~on_edge].all()
    assert torch.equal(code >= 32, y < 0)


def test_zeros_decode_to_exact_zeros():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        payload = wht6.encode(torch.zeros(4, 512, dtype=dtype))
        assert not payload.any()
        assert torch.equal(wht6.decode(payload, (4, 512), dtype), torch.zeros(4, 512, dtype=dtype))


def test_one_large_value_among_tiny_ones():
    g = torch.Generator().manual_seed(1)
    x = 1e-3 * torch.randn(2, 512, generator=g)
    x[0, 77], x[1, 300] = 1.0e4, -3.0e3
    payload = wht6.encode(x)
    assert_within_format_bound(x, payload)
    d = wht6.decode(payload, (2, 512), torch.float32)
    # The spike sets its sub-block's scale (s_g <= |spike| / 32 (1 + 2**-7)); the error of
    # the whole sub-block is at most 32 E_MAX s_g, so the spike keeps ~2% accuracy and sign.
    for r, c in ((0, 77), (1, 300)):
        assert abs(d[r, c] - x[r, c]) <= E_MAX * abs(x[r, c]) * (1 + 2**-7)
        assert torch.sign(d[r, c]) == torch.sign(x[r, c])
    # Blocks without a spike keep scales fitted to their own tiny values.
    _, _, scale_bits = ref.unpack(payload, 512)
    scale = (scale_bits.to(torch.int32) << 16).view(torch.float32).double()
    own_max = rotated(x).abs().reshape(2, 2, -1).amax(-1)
    assert scale[0, 1] <= own_max[0, 1] * (1 + 2**-7) and scale[1, 0] <= own_max[1, 0] * (1 + 2**-7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_poisons_exactly_its_block(bad):
    x = make("gaussian", 3, 1024).to(torch.float32)
    x[1, 600] = bad  # block 2 of row 1
    d = wht6.decode(wht6.encode(x), (3, 1024), torch.float32).reshape(3, 4, 256)
    poisoned = torch.zeros(3, 4, dtype=torch.bool)
    poisoned[1, 2] = True
    assert d[poisoned].isnan().all()
    assert d[~poisoned].isfinite().all()
    other = wht6.encode(torch.ones(3, 1024))
    s = wht6.decode_accumulate([other, wht6.encode(x)], (3, 1024), torch.bfloat16).reshape(3, 4, 256)
    assert s[poisoned].isnan().all() and s[~poisoned].isfinite().all()


# ---------------------------------------------------------------- range

# One block of each kind per row; payload w draws its own values. Out of range (NaN):
# "min_normal" (rotated max ~2**-127 < SCALE_MIN) and "lone" (one value: in fp32 2**-149,
# whose rotation rounds to 0; in bf16 2**-126, as the Triton interpreter misconverts bf16
# subnormals) always, "overflow" (2e38 at 3 places, same sign in every payload) once
# W >= 2 payloads sum past the fp32 max. "spike": one 1e37 among 1e-32 values.
RANGE_KINDS = ("unit", "huge", "tiny", "min_normal", "zero", "lone", "overflow", "spike")
HUGE, TINY = 2.0**123, 2.0**-106  # ~1.06e37 and ~1.2e-32: "huge" and "tiny" are "unit" times these


def range_input(w: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + w)
    unit = torch.randn(rows, ref.BLOCK, generator=g, dtype=torch.float64)
    b = dict(unit=unit, huge=unit * HUGE, tiny=unit * TINY, min_normal=unit * 2.0**-126,
             spike=TINY * torch.randn(rows, ref.BLOCK, generator=g, dtype=torch.float64))
    b.update((k, torch.zeros_like(unit)) for k in ("zero", "lone", "overflow"))
    b["lone"][:, 5] = 2.0**-149 if dtype == torch.float32 else 2.0**-126
    b["overflow"][:, :3] = 2e38
    b["spike"][:, 37] = 1e37 * (1 + w / 4)
    return torch.cat([b[k] for k in RANGE_KINDS], 1).to(dtype)


def check_range(encode, decode_accumulate, dtype: torch.dtype, rows: int = 2) -> tuple:
    """Round trip and W = 2, 4 sums of ``range_input`` rows with the given codec functions
    (reference or kernels): NaN exactly for the out-of-range blocks, each block the same
    as when coded alone, "huge" exactly (and "tiny" to a subnormal ulp) the "unit" result
    scaled, every other finite block within the relative RMS bound of the float64 sum.
    Returns inputs, payloads and {W: result}, for comparison with the reference."""
    nblk = len(RANGE_KINDS)
    xs = [range_input(w, rows, dtype) for w in range(4)]
    pays = [encode(x) for x in xs]
    alone = [encode(x.reshape(rows * nblk, ref.BLOCK)) for x in xs]  # one block per row
    sub_ulp = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # NaN-aware equality
    done = {}
    for n in (1, 2, 4):
        d = done[n] = decode_accumulate(pays[:n], (rows, nblk * ref.BLOCK), dtype).cpu()
        d_alone = decode_accumulate(alone[:n], (rows * nblk, ref.BLOCK), dtype).cpu().reshape(d.shape)
        assert torch.equal(d.view(bits), d_alone.view(bits)), f"W={n}: neighbours interfere"
        b = dict(zip(RANGE_KINDS, d.double().reshape(rows, nblk, -1).unbind(1)))
        exact = dict(zip(RANGE_KINDS, sum(x.double() for x in xs[:n]).reshape(rows, nblk, -1).unbind(1)))
        out = {"min_normal", "lone"} | ({"overflow"} if n > 1 else set())
        for kind in RANGE_KINDS:
            assert (b[kind].isnan().all() if kind in out else b[kind].isfinite().all()), (n, kind)
        assert torch.equal(b["zero"], torch.zeros_like(b["zero"]))
        assert torch.equal(b["huge"], b["unit"] * HUGE), n
        assert ((b["tiny"] - b["unit"] * TINY).abs() <= sub_ulp).all(), n
        for kind in ("unit", "overflow", "spike") if n == 1 else ("unit", "spike"):
            rel = (b[kind] - exact[kind]).norm() / exact[kind].norm()
            assert rel <= wht6.SUM_REL_RMS_BOUND, (n, kind, rel.item())
    return xs, pays, done


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_range_reference(dtype):
    check_range(wht6.encode, wht6.decode_accumulate, dtype)


def check_fp16_overflow(encode, decode_accumulate) -> None:
    """fp16 output of a sum past 65504: that block is NaN, never Inf; others unaffected."""
    x = make("gaussian", 2, 512, seed=4).to(torch.float32)
    x[1, 256:] *= 3e4  # twice that block reaches past the fp16 max
    pays = [encode(x)] * 2
    d32, d16 = (decode_accumulate(pays, (2, 512), dt).cpu() for dt in (torch.float32, torch.float16))
    over = torch.zeros(2, 512, dtype=torch.bool)
    over[1, 256:] = True
    assert d32.isfinite().all() and d16[over].isnan().all()
    assert torch.allclose(d16[~over].float(), d32[~over], rtol=2**-10, atol=2**-12 * d32[~over].abs().max().item())


def test_sum_beyond_the_output_dtype_is_nan():
    check_fp16_overflow(wht6.encode, wht6.decode_accumulate)


def test_decode_accumulate_equals_sum_of_decodes():
    xs = [make(k, 16, 1024, seed=i) for i, k in enumerate(["gaussian", "student_t3", "outlier_channels"])]
    payloads = [wht6.encode(x.to(torch.bfloat16)) for x in xs]
    total = wht6.decode_accumulate(payloads, (16, 1024), torch.float32).double()
    parts = sum(wht6.decode(p, (16, 1024), torch.float32).double() for p in payloads)
    assert torch.allclose(total, parts, rtol=1e-6, atol=1e-6 * parts.abs().max().item())


def test_encode_is_row_local_and_deterministic():
    x = make("student_t3", 10, 768).to(torch.bfloat16)
    payload = wht6.encode(x)
    assert torch.equal(payload, wht6.encode(x.clone()))
    assert torch.equal(payload[3:7], wht6.encode(x[3:7]))
    out = torch.full_like(payload, 0xFF)
    assert wht6.encode(x, out=out) is out and torch.equal(out, payload)


@pytest.mark.parametrize("kind,target", [("gaussian", 1.0), ("outlier_channels", 0.5), ("student_t3", 1.0)])
def test_error_vs_int6_baseline(kind, target):
    """Issue-3 targets: Gaussian <= 1.0x INT6, outlier channels <= 0.5x; Student-t is at
    least better than INT6 here. Its 0.5x goal is not met (0.58x); tools/bench_codec.py
    prints it as NOT met in every accuracy table."""
    x = make(kind, 128, 2048, seed=7).to(torch.bfloat16)
    exact = x.double()
    err = (wht6.decode(wht6.encode(x), x.shape, torch.float32).double() - exact).norm()
    err_int6 = (baseline_int6.round_trip(x).double() - exact).norm()
    assert err / err_int6 <= target


def test_int6_baseline_follows_its_format():
    x = make("gaussian", 8, 256).to(torch.float32)
    codes, scales = baseline_int6.quantize(x)
    assert codes.min() >= -32 and codes.max() <= 31
    s = scales.float().repeat_interleave(32, dim=1).abs()
    assert ((baseline_int6.round_trip(x) - x).abs() <= s * (1 + 1e-6)).all()  # clip side: one step
    assert torch.equal(baseline_int6.round_trip(torch.zeros(2, 64)), torch.zeros(2, 64))


@pytest.mark.parametrize("call,exc,words", [
    (lambda: wht6.encode([[1.0]]), TypeError, "x must be a torch.Tensor"),
    (lambda: wht6.encode(torch.zeros(256)), ValueError, "x must be 2-D"),
    (lambda: wht6.encode(torch.zeros(2, 256, dtype=torch.int32)), TypeError, "x dtype"),
    (lambda: wht6.encode(torch.zeros(2, 300)), ValueError, "multiple of 256"),
    (lambda: wht6.encode(torch.zeros(512, 2).t()), ValueError, "unit stride"),
    (lambda: wht6.decode(torch.zeros(2, 200), (2, 256), torch.float32), TypeError, "torch.uint8"),
    (lambda: wht6.decode(torch.zeros(2, 199, dtype=torch.uint8), (2, 256), torch.float32), ValueError, "shape (2, 200)"),
    (lambda: wht6.decode(torch.zeros(2, 200, dtype=torch.uint8), (2, 256), torch.int8), TypeError, "dtype must be"),
    (lambda: wht6.decode(torch.zeros(2, 200, dtype=torch.uint8), (2,), torch.float32), ValueError, "shape must be"),
    (lambda: wht6.decode_accumulate([], (2, 256), torch.float32), ValueError, "non-empty"),
    (lambda: wht6.decode_accumulate([torch.zeros(2, 200, dtype=torch.uint8), torch.zeros(2, 100, dtype=torch.uint8)],
                                    (2, 256), torch.float32), ValueError, "payloads[1]"),
    (lambda: wht6.bits_per_value(100), ValueError, "cols must be"),
])
def test_bad_arguments_raise_clear_errors(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


# ---------------------------------------------------------------- kernels vs reference

def _code_index(code: torch.Tensor) -> torch.Tensor:
    """Signed level index: -32..-1 for negative codes, 0..31 for positive ones."""
    return torch.where(code >= 32, -1 - (code & 31), code & 31)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    exp = torch.floor(torch.log2(x.abs().clamp(min=torch.finfo(dtype).tiny)))
    return torch.pow(2.0, exp - mant)


def assert_payloads_agree(kernel: torch.Tensor, expected: torch.Tensor, x: torch.Tensor) -> None:
    """Identical bytes, except where the kernel's fp32 rotation sums (butterflies, one
    rounding per stage) round differently from the reference's exact sums and a value lands on the
    other side of a decision edge: then a code, sub-scale code or scale moves by ONE
    step, in at most 1e-3 of the places, and the format bound still holds."""
    cols = x.shape[1]
    kernel = kernel.cpu()
    if torch.equal(kernel, expected):
        return
    (ck, sk, bk), (ce, se, be) = ref.unpack(kernel, cols), ref.unpack(expected, cols)
    for name, a, b in (("code", _code_index(ck), _code_index(ce)), ("sub-scale", sk, se), ("scale", bk, be)):
        moved = a != b
        assert moved.float().mean().item() <= 1e-3, f"{name}: {moved.sum().item()} differ"
        assert (a - b).abs().max().item() <= 1, f"{name}: moved by more than one step"
    assert_within_format_bound(x.float().cpu(), kernel)


def assert_decoded_agree(kernel: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one output ulp, plus what the kernel's 2-piece bf16 split of the fp32 sums
    may drop: each rotated value to 2**-17 of itself, i.e. at most 2**-17 * 32 = 2**-12
    of the largest output of the sub-block. NaN exactly where the reference has NaN,
    which also proves the (NaN-poisoned) output was fully written."""
    k, e = kernel.cpu().double(), expected.double()
    assert torch.equal(k.isnan(), e.isnan()), "NaN pattern differs (output not fully written?)"
    rows, cols = e.shape
    finite = e.isfinite()
    sub_max = e.where(finite, 0).abs().reshape(rows, -1, 32).amax(-1, keepdim=True)
    tol = _ulp(e, dtype) + 2.0**-12 * sub_max.expand(rows, -1, 32).reshape(rows, cols)
    assert ((k - e).abs() <= tol)[finite].all()


def check_kernels_against_reference(device: str, cases: list, seed: int = 0) -> None:
    """Run the three kernels on ``device`` for (rows, cols, dtype, row_pad) cases with
    poisoned outputs; compare with the reference. Called by the GPU tests directly and,
    under TRITON_INTERPRET=1, by the interpreter test in a subprocess."""
    from radiance_ar.wht6.wht6_decode_accumulate import wht6_decode_accumulate
    from radiance_ar.wht6.wht6_encode import wht6_encode

    kinds = ["gaussian", "student_t3", "outlier_channels", "outlier_tokens"]
    for i, (rows, cols, dtype, row_pad) in enumerate(cases):
        xs = [make(kinds[(i + w) % 4], rows, cols, seed + 10 * i + w).to(dtype) for w in range(8)]
        xs[0][rows // 2, cols // 3] = float("nan")
        padded = torch.zeros(rows, cols + row_pad, dtype=dtype, device=device)
        padded[:, :cols] = xs[0].to(device)
        x_dev = padded[:, :cols]  # row stride cols + row_pad
        pay = torch.full(wht6.payload_shape(rows, cols), 0xFF, dtype=torch.uint8, device=device)
        wht6_encode(x_dev, pay)
        expected = ref.encode(xs[0])
        assert_payloads_agree(pay, expected, xs[0])
        payloads = [expected] + [ref.encode(x) for x in xs[1:]]
        for n in (1, 3, 8):
            out = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
            dev_payloads = [p.to(device) for p in payloads[:n]]
            wht6_decode_accumulate(dev_payloads, (rows, cols), dtype, out)
            assert_decoded_agree(out, ref.decode_accumulate(payloads[:n], (rows, cols), dtype), dtype)


def check_range_kernels(device: str) -> None:
    """``check_range`` on the three kernels, whose payloads and results must also agree
    with the reference's (NaN in the same places)."""
    from radiance_ar.wht6.wht6_decode_accumulate import wht6_decode_accumulate
    from radiance_ar.wht6.wht6_encode import wht6_encode

    def decode_accumulate(pays, shape, dtype):
        return wht6_decode_accumulate([p.to(device) for p in pays], shape, dtype)

    def encode(x):
        return wht6_encode(x.to(device)).cpu()

    check_fp16_overflow(encode, decode_accumulate)
    for dtype in (torch.float32, torch.bfloat16):
        xs, pays, done = check_range(encode, decode_accumulate, dtype)
        for x, p in zip(xs, pays):
            assert_payloads_agree(p, ref.encode(x), x)
        for n, d in done.items():
            assert_decoded_agree(d, ref.decode_accumulate(pays[:n], tuple(d.shape), dtype), dtype)


def test_kernel_comparisons_can_fail():
    """The tolerances used against the kernels reject real defects."""
    x = make("gaussian", 4, 512).to(torch.float32)
    good = ref.encode(x)
    jumped = good.clone()
    jumped[0, 0] ^= 0x02  # one code moved by two levels
    many = good.clone()
    many[:, :256] ^= 0x11  # every low-plane code changed
    for bad in (jumped, many):
        with pytest.raises(AssertionError):
            assert_payloads_agree(bad, good, x)
    decoded = ref.decode(good, (4, 512), torch.bfloat16)
    unwritten = decoded.clone()
    unwritten[2, 100] = float("nan")
    off_by_two_ulps = decoded.float().clone()
    i = int(decoded[1, :32].float().abs().argmax())  # the sub-block's largest: tol ~ 1 ulp
    off_by_two_ulps[1, i] += 2 * _ulp(decoded[1, i].float(), torch.bfloat16)
    for bad in (unwritten, off_by_two_ulps.to(torch.bfloat16)):
        with pytest.raises(AssertionError):
            assert_decoded_agree(bad, decoded, torch.bfloat16)


INTERPRETER_CASES = [(3, 512, torch.bfloat16, 0), (17, 768, torch.float16, 256), (2, 256, torch.float32, 0)]


def _under_interpreter(call: str) -> None:
    """Run ``t.<call>`` (t = this module) with the Triton kernels on CPU tensors under
    TRITON_INTERPRET=1 (set before triton is imported, hence a subprocess)."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    code = f"import sys, torch; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import test_wht6 as t; t.{call}"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(ROOT / "tests")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_interpreter_kernels_match_reference():
    """Deselect the interpreter tests with -k 'not interpreter'."""
    _under_interpreter("check_kernels_against_reference('cpu', t.INTERPRETER_CASES)")


def exact_rotation_input(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 values whose rotation every kernel computes exactly (small integers times a
    power of two per row: no partial sum needs more than 24 bits), with an all -0.0
    sub-block, a sub-block of +-0.0 and one value, a zero block and a NaN block, and
    values at 2**-100 and 2**100."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-100, 101, (rows, cols), generator=g).double()
    x *= 2.0 ** torch.randint(-30, 31, (rows, 1), generator=g).double()
    x[0, :32] = -0.0
    x[0, 32:64] = torch.where(torch.arange(32) % 2 == 0, -0.0, 0.0)
    x[0, 40] = -3.0
    x[1 % rows, :256] = 0.0
    x[-1, -256:] *= 2.0**-100
    x[-1, -512] = float("nan")
    x[rows // 2, :256] *= 2.0**100
    return x.to(torch.bfloat16)


def check_exact_encode(device: str) -> None:
    """Where the rotation is exact, every other step of the kernels is the reference's
    fp32 operations: the payloads are the same bytes, for every launch shape."""
    from radiance_ar.wht6 import wht6_launch
    from radiance_ar.wht6.wht6_encode import wht6_encode

    for rows, cols in ((6, 768), (3, 1536)):
        x = exact_rotation_input(rows, cols, seed=rows)
        expected = ref.encode(x)
        for shape in (None,) + wht6_launch.CANDIDATES[:2]:
            got = wht6_encode(x.to(device), shape=shape).cpu()
            assert torch.equal(got, expected), (rows, cols, shape, (got != expected).sum().item())


def check_launch_shapes_agree(device: str) -> None:
    """Every candidate launch shape gives the table's bits (decode-accumulate of 3)."""
    from radiance_ar.wht6 import wht6_launch
    from radiance_ar.wht6.wht6_decode_accumulate import wht6_decode_accumulate

    rows, cols = 5, 1024
    pays = [ref.encode(make("student_t3", rows, cols, seed=w).to(torch.bfloat16)).to(device) for w in range(3)]
    table = wht6_decode_accumulate(pays, (rows, cols), torch.bfloat16).cpu()
    for shape in wht6_launch.CANDIDATES:
        got = wht6_decode_accumulate(pays, (rows, cols), torch.bfloat16, launch_shape=shape).cpu()
        assert torch.equal(got.view(torch.int16), table.view(torch.int16)), shape


def test_interpreter_exact_payloads_and_launch_shapes():
    _under_interpreter("check_exact_encode('cpu'); t.check_launch_shapes_agree('cpu')")


def test_launch_shape_is_checked():
    from radiance_ar.wht6 import wht6_launch

    assert wht6_launch.check_shape((128, 4)) == (128, 4)
    for bad, exc in (((96, 4), ValueError), ((64, 4), ValueError), ((128, 3), ValueError),
                     ([128, 4], TypeError), ((128.0, 4), TypeError)):
        with pytest.raises(exc, match="launch shape"):
            wht6_launch.check_shape(bad)
    for shape in wht6_launch.CANDIDATES + tuple(wht6_launch.ENCODE.values()) + tuple(wht6_launch.DECODE.values()):
        assert wht6_launch.check_shape(shape) == shape


def test_package_imports_without_triton():
    """backends/kernels' loading convention: every module a CPU-only install imports
    (the backends, the front ends) works without Triton, and the CPU codec runs."""
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def no_triton(name, *a, **k):\n"
        "    if name == 'triton' or name.startswith('triton.'):\n"
        "        raise ImportError('no Triton here')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = no_triton\n"
        "import torch, radiance_ar.backends, radiance_ar.backends.oneshot_wht6, radiance_ar.backends.sdma_wht6\n"
        "from radiance_ar.backends.kernels import oneshot_wht6, reduce_sum\n"
        "from radiance_ar.launch import pointers\n"
        "from radiance_ar.wht6 import wht6_launch\n"
        "from radiance_ar import wht6\n"
        "x = torch.randn(2, 256)\n"
        "assert wht6.decode(wht6.encode(x), (2, 256), torch.float32).shape == (2, 256)\n"
        "assert 'triton' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_interpreter_range():
    _under_interpreter("check_range_kernels('cpu')")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_match_reference(dtype):
    g = torch.Generator().manual_seed(3)
    cases = [(int(torch.randint(1, 300, (1,), generator=g)), 256 * int(torch.randint(1, 24, (1,), generator=g)),
              dtype, 64 * int(torch.randint(0, 3, (1,), generator=g))) for _ in range(4)]
    check_kernels_against_reference("cuda", cases + [(64, 5120, dtype, 0)], seed=5)


@pytest.mark.gpu
def test_gpu_range():
    check_range_kernels("cuda")


@pytest.mark.gpu
def test_gpu_exact_payloads_and_launch_shapes():
    check_exact_encode("cuda")
    check_launch_shapes_agree("cuda")


@pytest.mark.gpu
def test_gpu_public_api_dispatches_to_kernels():
    x = make("outlier_channels", 128, 5120).to(torch.bfloat16)
    payload = wht6.encode(x.cuda())
    assert payload.is_cuda
    assert_payloads_agree(payload, ref.encode(x), x.float())
    d = wht6.decode_accumulate([payload, payload], (128, 5120), torch.float32)
    assert d.is_cuda
    assert_decoded_agree(d, ref.decode_accumulate([payload.cpu()] * 2, (128, 5120), torch.float32), torch.float32)


def test_row_divisor_is_an_exact_division_for_every_31_bit_dividend():
    # The encode kernel finds a sub-block's row by multiply-high and shift instead of a
    # division: checked here against // at the edges of every quotient and at random.
    pytest.importorskip("triton")
    from radiance_ar.wht6.wht6_tile import row_divisor

    g = torch.Generator().manual_seed(0)
    divisors = list(range(8, 4097, 8)) + [2**k for k in range(1, 31)] + [
        int(d) for d in torch.randint(2, 2**31 - 1, (200,), generator=g)]
    for d in divisors:
        magic, shift = row_divisor(d)
        m = magic & 0xFFFFFFFF
        fs = [0, 1, d - 1, d, d + 1, 2**31 - 1, 2**31 - 2] + [
            int(f) for f in torch.randint(0, 2**31 - 1, (64,), generator=g)]
        fs += [q * d + r for q in (2**31 // d - 1, 2**31 // d) for r in (-1, 0, 1)
               if 0 <= q * d + r < 2**31]
        for f in fs:
            assert ((f * m) >> 32) >> shift == f // d, (d, f)
    with pytest.raises(ValueError, match="out of range"):
        row_divisor(1)
