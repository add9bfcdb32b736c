"""Encode math of the wht6 codec (@triton.jit helpers on one tile, laid out as in
``wht6_tile``): sub-blocks of values -> packed payload words and block records.

Encode: y = H32 (x / 32): the 1/32 comes first, so no partial sum exceeds max |x| and
no finite input overflows. It is exact except for |x| < 2**-121, which x / 32 rounds
to the fp32 subnormal grid (2**-149): under 2**-14 of the smallest code step. Scales,
sub-scales and codes are the reference's fp32 operations in its order, with two exact
rewrites: q = trunc(fma(s, 63, -47.25)) is floor((s - 0.75) * 63) (s - 0.75 is exact
for s in [0.75, 1.25], the fma rounds the same real number once), and s =
sqrt_rn(u + 9/16) is computed, on NVIDIA, as the fast path of NVIDIA's own sqrt.rn
(rsqrt.approx, then one fma correction; for inputs in [0.5625, 2] the IEEE result)
without its branch to the slow path, which no input here takes.

Fewer instructions, same bits (encode 28.2 -> 23.4 SASS instructions per value,
``radiance_ar.diagnostics.sass_count``): one integer max over each block's sub-block maxima replaces
three reductions (non-zero, non-finite, block max); the sub-scale code comes from an
estimate rounded to nearest and one exact upward fix-up (the estimate is within 1e-5 of
the real root, so it is the answer or one below it); the record is built in two 32-bit
halves; the sign bits go straight into the high plane (a funnel shift per value); the
two halves of a high-plane word are merged by one byte permute on NVIDIA (``_halves``).
The kernel (``wht6_encode``) adds: bf16 read as 32-bit words without masks (sub-blocks
past the end are clamped to the last one and never stored) and the row of a sub-block by
multiply-high and shift (``wht6_tile.row_divisor``).

Helpers:
  encode_tile(x0..x3, T, NV_SQRT, nz=None) -> (nib [T, 4] i32, high [T, 2] i32, rec [T] i64)
"""
import triton
import triton.language as tl

from radiance_ar.wht6 import wht6_tile
from radiance_ar.wht6 import reference

SCALE_MIN = tl.constexpr(reference.SCALE_MIN)
SCALE_MIN_BITS = tl.constexpr(0x06800000)  # of SCALE_MIN = 2**-114
SIGN_BITS = tl.constexpr(-1431655766)  # 0xAAAAAAAA: the odd bits of a high-plane word
BF16_INF_BITS = tl.constexpr(0x7F80)
BF16_NAN_BITS = tl.constexpr(0x7FC0)
NORM = tl.constexpr(1.0 / reference.SUB)  # the forward rotation is H32 / 32


@triton.jit
def _max_abs(y):
    return tl.max(tl.abs(y), axis=1)  # the abs folds into the max: no other use


@triton.jit
def _codes(y, inv, NV_SQRT: tl.constexpr):
    """Rotated values y [T, 8] and 1 / s_g [T] -> code magnitudes [T, 8] (int32)
    q = floor((sqrt(|y| / s_g + 9/16) - 3/4) * 63) <= 31 (|y| <= s_g; the reference's
    clamps to 1 and to 31 change nothing then). The sign bits: ``_signs``."""
    u = y * inv[:, None]  # |u| = |y| * inv (inv >= 0); the abs folds into the add
    if NV_SQRT:
        # NVIDIA's sqrt.rn fast path (module doc) run on n = -(|u| + 9/16): each step is
        # the exact negation of the one on |u| + 9/16, and no unary minus is needed
        # (Triton 3.6 makes one an extra 0 - x per value); q = trunc(fma(-s, -63, -47.25)).
        n = -0.5625 - tl.abs(u)
        r = tl.math.rsqrt(tl.abs(n))
        neg_s = n * r
        neg_s = tl.fma(tl.fma(neg_s, neg_s, n), r * 0.5, neg_s)
        q = tl.fma(neg_s, -63.0, -47.25).to(tl.int32)
    else:
        q = tl.fma(tl.sqrt_rn(tl.abs(u) + 0.5625), 63.0, -47.25).to(tl.int32)
    return q


@triton.jit
def _columns(y, T: tl.constexpr):
    """[T, 8] -> its 8 columns [T], as uint32 bits."""
    even, odd = tl.split(tl.reshape(y.to(tl.uint32, bitcast=True), (T, 4, 2)))
    e04, e26 = tl.split(tl.reshape(even, (T, 2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, (T, 2, 2)))
    c0, c4 = tl.split(e04)
    c2, c6 = tl.split(e26)
    c1, c5 = tl.split(o15)
    c3, c7 = tl.split(o37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _append_signs(acc, y, T: tl.constexpr):
    """acc shifted up by 2 bits per value of y [T, 8] (column 7 first), with the top two
    bits of each value (sign, then an exponent bit) shifted in: a funnel shift each."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _columns(y, T)
    acc = (acc << 2) | (c7 >> 30)
    acc = (acc << 2) | (c6 >> 30)
    acc = (acc << 2) | (c5 >> 30)
    acc = (acc << 2) | (c4 >> 30)
    acc = (acc << 2) | (c3 >> 30)
    acc = (acc << 2) | (c2 >> 30)
    acc = (acc << 2) | (c1 >> 30)
    return (acc << 2) | (c0 >> 30)


@triton.jit
def _signs(ya, yb, T: tl.constexpr):
    """The high-plane word of ya, yb [T, 8] (ya in bits 0-15): the sign of value k at
    bit 2k + 1 (of yb's at 16 + 2k + 1); the even bits are junk (mask with SIGN_BITS)."""
    acc = _append_signs(tl.zeros([T], tl.uint32), yb, T)
    return _append_signs(acc, ya, T).to(tl.int32, bitcast=True)


@triton.jit
def _pack(code, T: tl.constexpr):
    """8 codes per sub-block [T, 8] -> (nibble-plane word [T], their high bits [T]: code
    bit 4 of codes 0-3 at bits 0, 2, 4, 6 and of codes 4-7 at bits 16, 18, 20, 22; the
    other bits of bytes 0 and 2 are 0, bytes 1 and 3 are junk). Bytes of 4 codes first
    (even and odd columns), then nibble and 2-bit fields (``_halves`` puts the two bytes
    of high bits together)."""
    even, odd = tl.split(tl.reshape(code, (T, 4, 2)))
    at_byte = (8 * tl.arange(0, 4))[None, :]
    b_even = tl.sum(even << at_byte, axis=1)
    b_odd = tl.sum(odd << at_byte, axis=1)
    nib = (b_even & 0x0F0F0F0F) | ((b_odd & 0x0F0F0F0F) << 4)
    pairs = ((b_even >> 4) & 0x03030303) | ((b_odd >> 2) & 0x0C0C0C0C)  # codes 2k, 2k+1
    quads = pairs | (pairs >> 4)  # codes 4k..4k+3 in bits 0-7 and 16-23
    return nib, quads


@triton.jit
def _halves(qa, qb, NV: tl.constexpr):
    """``_pack``'s high bits of two packs -> one high-plane word: bytes 0 and 2 of qa,
    then bytes 0 and 2 of qb (on NVIDIA one byte permute; the same bits elsewhere)."""
    if NV:
        h = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x6420;", "=r,r,r", [qa, qb],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        h = (qa & 0xFF) | ((qa >> 8) & 0xFF00)
        h = h | (((qb & 0xFF) | ((qb >> 8) & 0xFF00)) << 16)
    return h


@triton.jit
def encode_tile(x0, x1, x2, x3, T: tl.constexpr, NV_SQRT: tl.constexpr, nz=None):
    """Sub-blocks x0..x3 (fp32; zeros or anything where masked) -> packed payload words: nibble
    plane [T, 4] and high plane [T, 2] (int32), and each sub-block's block record [T]
    (int64, the same in the 8 sub-blocks of a block). ``NV_SQRT``: NVIDIA only."""
    # Per sub-block: whether any x is non-zero (tested on x: its rotation may round to 0);
    # ``nz``: the caller's non-negative int32 [T], non-zero iff some x is.
    if nz is None:
        bits = (x0.to(tl.int32, bitcast=True) | x1.to(tl.int32, bitcast=True)) | (
            x2.to(tl.int32, bitcast=True) | x3.to(tl.int32, bitcast=True))
        nz = tl.reduce(bits, 1, wht6_tile.bit_or) & 0x7FFFFFFF
    nonzero = tl.minimum(nz, 1)
    y0, y1, y2, y3 = wht6_tile.wht32_scaled_in(x0, x1, x2, x3, NORM, T)
    sub_max = tl.maximum(tl.maximum(_max_abs(y0), _max_abs(y1)),
                         tl.maximum(_max_abs(y2), _max_abs(y3)))
    # One integer max over the block does the work of three reductions: sub_max >= 0, so
    # its bits order as its values; a NaN x makes all 32 y NaN (a max skips NaN but
    # returns it when all are) and +-Inf makes them +-Inf or NaN, so a non-finite
    # sub-block's bits are >= 0x7F800000, above every finite one; and a sub-block of
    # non-zero x whose rotation rounded to 0 counts as 1 (the smallest subnormal's bits).
    key = wht6_tile.block_max(tl.maximum(sub_max.to(tl.int32, bitcast=True) & 0x7FFFFFFF, nonzero), T)
    # Round the block max up to bf16 so that no value clips (unsigned: NaN bits wrap).
    scale_bits = ((key + 0xFFFF).to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    # Out of range (as in reference.encode): NaN/Inf or a scale beyond bf16 (both make
    # scale_bits >= 0x7F80), or a non-zero block (key >= 1) whose max is below SCALE_MIN.
    bad = (scale_bits >= BF16_INF_BITS) | ((key - 1).to(tl.uint32, bitcast=True) < SCALE_MIN_BITS - 1)
    scale_bits = tl.where(bad, 0, scale_bits)
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    sub_max = tl.minimum(sub_max, scale)
    # Smallest c with fp32(scale * (c/63)^2) >= sub_max: that fp32 product is scale *
    # (c/63)^2 to 7 ulp, so the smallest c is within 1e-5 of ceil(e), e = 63 sqrt(sub_max /
    # scale), and round(e) is c or c - 1 whenever e is known to 1 / 126: one fix-up up.
    # (A scale of 0, all-zero or bad block, reads as SCALE_MIN: e = 0, c = 0.)
    c = tl.fma(tl.sqrt(sub_max), tl.math.rsqrt(tl.maximum(scale, SCALE_MIN)) * 63.0, 0.5).to(tl.int32)
    c = tl.where(scale * wht6_tile.sub_ratio(c) < sub_max, c + 1, c)
    c = tl.where(bad, 0, c)
    sub_scale = scale * wht6_tile.sub_ratio(c)
    inv = tl.math.div_rn(1.0, sub_scale)  # inf where c = 0: those codes are cleared below
    n0, h0 = _pack(_codes(y0, inv, NV_SQRT), T)
    n1, h1 = _pack(_codes(y1, inv, NV_SQRT), T)
    n2, h2 = _pack(_codes(y2, inv, NV_SQRT), T)
    n3, h3 = _pack(_codes(y3, inv, NV_SQRT), T)
    # Codes 0 for blocks sent as NaN and for all-zero sub-blocks (c = 0, y = +-0).
    clear = (bad | (c == 0))[:, None]
    nib = tl.where(clear, 0, tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), (T, 4)))
    # The sign bits (code bit 5 = high-plane bit 2k + 1) straight from y's bits (a -0.0
    # only occurs in an all-zero sub-block, which is cleared), ORed into the odd bits
    # (zero in h: _codes gives q <= 31 without the sign).
    high = tl.join(_halves(h0, h1, NV_SQRT) | (_signs(y0, y1, T) & SIGN_BITS),
                   _halves(h2, h3, NV_SQRT) | (_signs(y2, y3, T) & SIGN_BITS))
    high = tl.where(clear, 0, high)
    # The record: c_g at bit 16 + 6g. Each half block's 4 codes first, as 24 bits (A of
    # g < 4, B of g >= 4; disjoint fields: the sums are ORs), then the high word
    # A >> 16 | B << 8 (a sum over the two halves of a block, by lanes g = k and k + 4)
    # and, where g < 4, the low word A << 16 | scale bits: 32-bit sums, 3 shuffles.
    g = tl.arange(0, T) % 8
    half = tl.reshape(tl.sum(tl.reshape(c << (6 * (g % 4)), (T // 8, 2, 4)), axis=2, keep_dims=True), (T // 8, 2, 1))
    half = tl.reshape(tl.broadcast_to(half, (T // 8, 2, 4)), (T,))
    part = tl.where(g < 4, half >> 16, half << 8)
    hi = tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(part, (T // 8, 2, 4)), axis=1, keep_dims=True), (T // 8, 2, 4)), (T,))
    lo = (half << 16) | tl.where(bad, BF16_NAN_BITS, scale_bits)
    rec = (hi.to(tl.int64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.int64)
    return nib, high, rec
