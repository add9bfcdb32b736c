"""The wht6 codec's test data and format bounds, shared by tests/test_wht6.py (the
reference and its format) and tests/test_wht6_kernels.py (the Triton kernels against it).

Error bounds come from the format, not from a run: with the compander u(t) = t(3+t)/4
and decision edges at t = k/31.5, a value in bin q is at most E_MAX * s_g from its level
(E_MAX is the largest level-to-edge distance in u, about 5/4 * 1/63), and the expected
squared error is the uniform-noise value sum (bin width * s_g)^2 / 12. The rotated
values are y = H32 x / 32 and x = H32 y, so a sub-block's decoded error norm is
sqrt(32) times its rotated one: at most 32 * E_MAX * s_g.
"""
from pathlib import Path

import torch

from radiance_ar import wht6
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
