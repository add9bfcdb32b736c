"""Decode math of the wht6 codec (@triton.jit helpers on one tile, laid out as in
``wht6_tile``): payload words -> dequantized rotated values -> decoded values.

Decode: each value is levels[code] * s_g with levels = ``reference.signed_levels(
HEADROOM)`` (the reference's products, bit for bit): the 32 magnitudes are loaded once
into registers and picked per value with ``tl.gather``, the sign bit is ORed in (a
negative level is the exact negation of its magnitude). Gathering from registers
rather than reading a global-memory table per value makes decode-accumulate W = 2/4/8
0.73/0.66/0.62 of a D2D copy against 0.67/0.60/0.55 (one H200, 2026-12-03, bits
unchanged; tools/results/2026-12-03-h200-codec-variants/), summed
over payloads in order in fp32, then x = H32 acc * 8 rounded once to the output dtype.
A sub-block whose block scale reaches 2**64 in any payload is rotated as acc * 2**-5
and scaled back by 2**5 (exact: such values are normal numbers), so no partial sum
overflows; a block holding a value that rounds to +-Inf in the output dtype is NaN.

Helpers:
  load_dequantize(pay, row, j, ok, subs_per_row, pay_row_bytes, levels) -> a0..a3, scale bits
  sum_payloads(p0..p7, n_payloads, row, j, ok, subs_per_row, pay_row_bytes, levels) -> the same, summed
  decode_tile(a0..a3, sbits, OUT_DTYPE, T) -> x0..x3 [T, 8] OUT_DTYPE
"""
import triton
import triton.language as tl

from radiance_ar.wht6 import wht6_tile
from radiance_ar.wht6 import reference

FP32_MAX = tl.constexpr(3.4028234663852886e38)
FP32_NAN_BITS = tl.constexpr(0x7FC00000)
UNHEADROOM = tl.constexpr(1.0 / reference.HEADROOM)
# Blocks whose scale's bf16 bits reach 2**64's are rotated at 2**-5 (32 terms of at most
# the bf16 max then sum to at most the bf16 max).
BIG_SCALE_BITS = tl.constexpr(0x5F80)
SHIFT_DOWN = tl.constexpr(2.0**-5)
UNSHIFT_DOWN = tl.constexpr(2.0**5)


@triton.jit
def _dequantize(nib, h16, sub_scale, levels, mags, GATHER: tl.constexpr):
    """The 8 codes of one nibble word nib [T] and their high bits h16 [T] -> [T, 8]
    values levels[code] * s_g. GATHER: picked from mags ([32, 8], the 32 non-negative
    levels in every column) and signed by code bit 5 (bit 2 col + 1 of h16); else read
    from the 64-entry table ``levels`` in global memory."""
    col = tl.arange(0, 8)[None, :]
    if GATHER:
        # The index (code bits 0-4) of each even column in a byte of xe, of each odd one in
        # a byte of xo: z has the high-plane bits of codes 2i, 2i + 1 (h16 bits 4i..4i + 3)
        # in byte i, so code 2i's bit 4 is bit 0 of byte i, code 2i + 1's bit 2.
        z = (h16 | (h16 << 8)) & 0x00FF00FF
        z = (z | (z << 4)) & 0x0F0F0F0F
        xe = (nib & 0x0F0F0F0F) | ((z << 4) & 0x10101010)
        xo = ((nib >> 4) & 0x0F0F0F0F) | ((z << 2) & 0x10101010)
        at = (8 * tl.arange(0, 4))[None, :]
        t = tl.reshape(tl.join(xe[:, None] >> at, xo[:, None] >> at), (nib.shape[0], 8))
        sign = (h16[:, None] << (30 - 2 * col)) & (-2147483648)
        v = (tl.gather(mags, t & 31, 0).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        code = ((nib[:, None] >> (4 * col)) & 15) | (((h16 << 4)[:, None] >> (2 * col)) & 0x30)
        v = tl.load(levels + code)
    return v * sub_scale[:, None]


@triton.jit
def load_dequantize(pay, row, j, ok, subs_per_row, pay_row_bytes, levels,
                    GATHER: tl.constexpr = True):
    """One payload's tile -> its rotated values times HEADROOM as a0..a3 [T, 8] fp32
    (sum up to 8 of these with +=), and the bf16 bits of each sub-block's block scale
    (int32 [T], for ``decode_tile``). ``levels``: ``wht6_launch.levels``' table.
    ``GATHER``: its first 32 entries go to registers and each value picks from them
    (faster at one warp per program; with 4 warps the gather crosses warps and the
    variants bench measured it slower than the table: 0.33 against 0.53 of a copy at
    (128, 4), W = 4, so the fused one-shot kernel reads the table)."""
    nib_ptrs, high_ptrs, rec_ptrs = wht6_tile.payload_ptrs(pay, row, j, subs_per_row, pay_row_bytes)
    # Masked sub-blocks (whole blocks past n_sub) are not read: their lanes compute
    # values that are never stored and enter no other block's result.
    nib = tl.load(nib_ptrs, mask=ok[:, None])
    high = tl.load(high_ptrs, mask=ok[:, None])
    rec = tl.load(rec_ptrs, mask=ok)
    scale_bits = (rec & 0xFFFF).to(tl.int32)
    c = ((rec >> (16 + 6 * (j & 7)).to(tl.int64)) & 63).to(tl.int32)
    sub_scale = (scale_bits << 16).to(tl.float32, bitcast=True) * wht6_tile.sub_ratio(c)
    words02, words13 = tl.split(tl.reshape(nib, (nib.shape[0], 2, 2)))
    n0, n2 = tl.split(words02)
    n1, n3 = tl.split(words13)
    h01, h23 = tl.split(high)  # the high bits of x0, x1 and of x2, x3
    mags = levels  # unused without GATHER
    if GATHER:
        mags = tl.broadcast_to(tl.load(levels + tl.arange(0, 32))[:, None], (32, 8))
    a0 = _dequantize(n0, h01 & 0xFFFF, sub_scale, levels, mags, GATHER)
    a1 = _dequantize(n1, (h01 >> 16) & 0xFFFF, sub_scale, levels, mags, GATHER)
    a2 = _dequantize(n2, h23 & 0xFFFF, sub_scale, levels, mags, GATHER)
    a3 = _dequantize(n3, (h23 >> 16) & 0xFFFF, sub_scale, levels, mags, GATHER)
    return a0, a1, a2, a3, scale_bits


@triton.jit
def _nth(w, p1, p2, p3, p4, p5, p6, p7):
    """Payload pointer number w (1..7, a run-time value)."""
    return tl.where(w == 1, p1, tl.where(w == 2, p2, tl.where(w == 3, p3, tl.where(
        w == 4, p4, tl.where(w == 5, p5, tl.where(w == 6, p6, p7))))))


@triton.jit
def sum_payloads(p0, p1, p2, p3, p4, p5, p6, p7, n_payloads, row, j, ok, subs_per_row,
                 pay_row_bytes, levels):
    """``load_dequantize`` of the first ``n_payloads`` payloads (1..8, in order p0, p1, ...),
    summed in fp32 in that order, and the max of their scale bits."""
    a0, a1, a2, a3, sbits = load_dequantize(p0, row, j, ok, subs_per_row, pay_row_bytes, levels)
    # A run-time loop, not an unrolled one: unrolled, the compiler hoists all W
    # payloads' loads and the kernel runs out of registers.
    for w in range(1, n_payloads):
        b0, b1, b2, b3, bits = load_dequantize(
            _nth(w, p1, p2, p3, p4, p5, p6, p7), row, j, ok, subs_per_row, pay_row_bytes, levels)
        a0 += b0
        a1 += b1
        a2 += b2
        a3 += b3
        sbits = tl.maximum(sbits, bits)
    return a0, a1, a2, a3, sbits


@triton.jit
def _any_overflow(x, OUT_DTYPE: tl.constexpr):
    """[T, 8] fp32 -> [T]: whether a value rounds to +-Inf in OUT_DTYPE."""
    over = tl.abs(x.to(OUT_DTYPE).to(tl.float32)) > FP32_MAX
    return tl.max(over.to(tl.int32), axis=1)


@triton.jit
def _poison_overflow(x0, x1, x2, x3, OUT_DTYPE: tl.constexpr, T: tl.constexpr):
    """x0..x3 with every block holding a value that rounds to +-Inf in OUT_DTYPE set to
    NaN (as reference.poison_overflow)."""
    over = (_any_overflow(x0, OUT_DTYPE) | _any_overflow(x1, OUT_DTYPE)) | (
        _any_overflow(x2, OUT_DTYPE) | _any_overflow(x3, OUT_DTYPE))
    poison = (wht6_tile.block_max(over, T) > 0)[:, None]
    nan = tl.full([T, 8], FP32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return (tl.where(poison, nan, x0), tl.where(poison, nan, x1), tl.where(poison, nan, x2),
            tl.where(poison, nan, x3))


@triton.jit
def decode_tile(a0, a1, a2, a3, sbits, OUT_DTYPE: tl.constexpr, T: tl.constexpr):
    """A sum of ``load_dequantize`` tiles and the max of their scale bits -> the decoded
    values x0..x3 [T, 8] in OUT_DTYPE: x = H32 acc / HEADROOM, rounded once; every block
    holding a value that rounds to +-Inf in OUT_DTYPE is all NaN."""
    big = sbits >= BIG_SCALE_BITS
    # Only blocks with a scale >= 2**64 can overflow fp32 or bf16 (|x| <= 32 max|acc| * 8).
    any_big = tl.max(big.to(tl.int32), axis=0) > 0
    if any_big:
        pre = tl.where(big, SHIFT_DOWN, 1.0)[:, None]
        a0 = a0 * pre
        a1 = a1 * pre
        a2 = a2 * pre
        a3 = a3 * pre
    post = tl.where(big, UNSHIFT_DOWN * UNHEADROOM, UNHEADROOM)[:, None]
    x0, x1, x2, x3 = wht6_tile.wht32_scaled_out(a0, a1, a2, a3, post, T)
    if OUT_DTYPE == tl.float16:  # 65504: any block may overflow
        x0, x1, x2, x3 = _poison_overflow(x0, x1, x2, x3, OUT_DTYPE, T)
    else:
        if any_big:
            x0, x1, x2, x3 = _poison_overflow(x0, x1, x2, x3, OUT_DTYPE, T)
    return x0.to(OUT_DTYPE), x1.to(OUT_DTYPE), x2.to(OUT_DTYPE), x3.to(OUT_DTYPE)
