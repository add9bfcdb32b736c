"""Per-tile math of the wht6 codec as @triton.jit helpers, shared by every kernel that
reads or writes wht6 payloads (encode, decode-accumulate, and the fused one-shot
all-reduce that encodes into a peer buffer and decodes peers' payloads in one kernel).

The wire format is specified in ``backends/wht6/__init__.py`` and, operation by
operation, in ``backends/wht6/reference.py``. Launch the kernels with
``enable_fp_fusion=False`` so that no multiply-add is contracted into an fma the
reference does not do (the fmas written here are exact rewrites, see below).

Tile. A program takes T consecutive sub-blocks (32 values each) in row-major order:
flat sub-block f is sub-block j = f % subs_per_row of row f // subs_per_row. T is a
multiple of 8 and cols of 256, so 8 aligned sub-blocks are one block. The values are
four [T, 8] fp32 tensors x_a: columns 8a..8a+7 of each sub-block. Each load of 8
contiguous bf16 is one 16-byte vector, and Triton's coalesced layout for it puts a
whole [T, 8] row in one thread, so each thread holds whole sub-blocks: the rotation,
the sub-block maxima, the code packing and the dequantization run in its registers
(no shared memory), and only block maxima and records cross 8 neighbouring lanes.
(The previous kernels rotated on tensor cores: the layout changes and shuffles around
the dot made encode 117 SASS instructions per value, here about 30: an offline sm_90
compile, the dynamic path counted; Nsight had it instruction-bound at 80% SM, 11% DRAM.)

Rotation: H32 = H4 (over a) (x) H8 (over the 8 columns of x_a): three butterfly stages
inside each x_a, two across them: 5 fp32 adds per value, in one fixed order, so every
kernel using these helpers rotates to the same bits. The reference sums exactly and
rounds once; a butterfly rounds where a partial sum needs more than 24 bits, so a
rotated value may differ from the reference's by an fp32 rounding (module doc of
``reference.py``): bf16 inputs spanning less than 2**16 rotate exactly.

Encode: y = H32 (x / 32): the 1/32 comes first, so no partial sum exceeds max |x| and
no finite input overflows. It is exact except for |x| < 2**-121, which x / 32 rounds
to the fp32 subnormal grid (2**-149): under 2**-14 of the smallest code step. Scales,
sub-scales and codes are the reference's fp32 operations in its order, with two exact
rewrites: q = trunc(fma(s, 63, -47.25)) is floor((s - 0.75) * 63) (s - 0.75 is exact
for s in [0.75, 1.25], the fma rounds the same real number once), and s =
sqrt_rn(u + 9/16) is computed, on NVIDIA, as the fast path of NVIDIA's own sqrt.rn
(rsqrt.approx, then one fma correction; for inputs in [0.5625, 2] the IEEE result)
without its branch to the slow path, which no input here takes.

Decode: each value is levels[code] * s_g with levels = ``reference.signed_levels(
HEADROOM)`` (the reference's products, bit for bit): the 32 magnitudes are loaded once
into registers and picked per value with ``tl.gather``, the sign bit is ORed in (a
negative level is the exact negation of its magnitude). Gathering from registers
instead of a global-memory table read per value made decode-accumulate W = 2/4/8
0.73/0.66/0.62 of a D2D copy against 0.67/0.60/0.55 (one H200, 2026-12-03, bits
unchanged; tools/results/2026-12-03-h200-codec-variants/), summed
over payloads in order in fp32, then x = H32 acc * 8 rounded once to the output dtype.
A sub-block whose block scale reaches 2**64 in any payload is rotated as acc * 2**-5
and scaled back by 2**5 (exact: such values are normal numbers), so no partial sum
overflows; a block holding a value that rounds to +-Inf in the output dtype is NaN.

Helpers:
  tile_of(pid, T, n_sub, subs_per_row) -> (row, j, ok): the tile's sub-blocks
  load_values(base, row, j, ok, row_stride, cols, PADDED) -> x0..x3 [T, 8] fp32
  store_values(base, row, j, ok, row_stride, cols, x0..x3, PADDED)
  encode_tile(x0..x3, T, NV_SQRT) -> (nib [T, 4] i32, high [T, 2] i32, rec [T] i64)
  store_payload(pay, row, j, ok, subs_per_row, pay_row_bytes, nib, high, rec)
  load_dequantize(pay, row, j, ok, subs_per_row, pay_row_bytes, levels) -> a0..a3, scale bits
  decode_tile(a0..a3, sbits, OUT_DTYPE, T) -> x0..x3 [T, 8] OUT_DTYPE
"""
import triton
import triton.language as tl

from backends.wht6 import reference

FP32_MAX = tl.constexpr(3.4028234663852886e38)
SCALE_MIN = tl.constexpr(reference.SCALE_MIN)
BF16_INF_BITS = tl.constexpr(0x7F80)
BF16_NAN_BITS = tl.constexpr(0x7FC0)
FP32_NAN_BITS = tl.constexpr(0x7FC00000)
INV63 = tl.constexpr(reference.INV63)  # rounded to fp32 where used, as in reference.INV63
NORM = tl.constexpr(1.0 / reference.SUB)  # the forward rotation is H32 / 32
UNHEADROOM = tl.constexpr(1.0 / reference.HEADROOM)
# Decode: blocks whose scale's bf16 bits reach 2**64's are rotated at 2**-5 (32 terms
# of at most the bf16 max then sum to at most the bf16 max).
BIG_SCALE_BITS = tl.constexpr(0x5F80)
SHIFT_DOWN = tl.constexpr(2.0**-5)
UNSHIFT_DOWN = tl.constexpr(2.0**5)


@triton.jit
def tile_of(pid, T: tl.constexpr, n_sub, subs_per_row):
    """Row and in-row index j (int32) of the T sub-blocks of tile ``pid``, and which of
    them exist (n_sub sub-blocks in all; callers check n_sub < 2**31)."""
    f = pid * T + tl.arange(0, T)
    row = f // subs_per_row
    return row, f - row * subs_per_row, f < n_sub


@triton.jit
def _column_mask(j, ok, cols, a: tl.constexpr, PADDED: tl.constexpr):
    if PADDED:
        mask = ok[:, None] & ((j * 32 + 8 * a)[:, None] + tl.arange(0, 8)[None, :] < cols)
    else:
        mask = ok[:, None]
    return mask


@triton.jit
def load_values(base, row, j, ok, row_stride, cols, PADDED: tl.constexpr):
    """The tile's values as fp32 x0..x3 [T, 8] (x_a: columns 8a..8a+7 of each
    sub-block; zeros where masked). ``PADDED``: cols is not a multiple of 256 and the
    columns from cols on read as zeros."""
    ptrs = (base + row.to(tl.int64) * row_stride + j * 32)[:, None] + tl.arange(0, 8)[None, :]
    x0 = tl.load(ptrs, mask=_column_mask(j, ok, cols, 0, PADDED), other=0.0).to(tl.float32)
    x1 = tl.load(ptrs + 8, mask=_column_mask(j, ok, cols, 1, PADDED), other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + 16, mask=_column_mask(j, ok, cols, 2, PADDED), other=0.0).to(tl.float32)
    x3 = tl.load(ptrs + 24, mask=_column_mask(j, ok, cols, 3, PADDED), other=0.0).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def store_values(base, row, j, ok, row_stride, cols, x0, x1, x2, x3, PADDED: tl.constexpr):
    """Store x0..x3 (as ``load_values`` lays them out; columns >= cols are not stored)."""
    ptrs = (base + row.to(tl.int64) * row_stride + j * 32)[:, None] + tl.arange(0, 8)[None, :]
    tl.store(ptrs, x0, mask=_column_mask(j, ok, cols, 0, PADDED))
    tl.store(ptrs + 8, x1, mask=_column_mask(j, ok, cols, 1, PADDED))
    tl.store(ptrs + 16, x2, mask=_column_mask(j, ok, cols, 2, PADDED))
    tl.store(ptrs + 24, x3, mask=_column_mask(j, ok, cols, 3, PADDED))


@triton.jit
def _butterfly(v):
    """[..., 2] -> [..., 2]: (a + b, a - b) along the last axis."""
    a, b = tl.split(v)
    return tl.join(a + b, a - b)


@triton.jit
def _wht8_upper(x, T: tl.constexpr):
    """The stages of H8 on column bits 1 and 2 of x [T, 8]."""
    v = tl.permute(tl.reshape(x, (T, 2, 2, 2)), (0, 1, 3, 2))
    x = tl.reshape(tl.permute(_butterfly(v), (0, 1, 3, 2)), (T, 8))
    v = tl.permute(tl.reshape(x, (T, 2, 4)), (0, 2, 1))
    return tl.reshape(tl.permute(_butterfly(v), (0, 2, 1)), (T, 8))


@triton.jit
def _wht8(x, T: tl.constexpr):
    """H8 along the columns of x [T, 8]."""
    return _wht8_upper(tl.reshape(_butterfly(tl.reshape(x, (T, 4, 2))), (T, 8)), T)


@triton.jit
def _wht8_scaled(x, scale, neg_scale, T: tl.constexpr):
    """H8 of x * scale (scale a power of two, neg_scale = -scale): the first stage is
    fma(b, +-scale, a * scale), which is a * scale +- b * scale rounded once: the same
    bits wherever b * scale is exact, and one multiply fewer per pair. (The negation is
    an argument: Triton 3.6 turns a unary minus into an extra 0 - x per value.)"""
    a, b = tl.split(tl.reshape(x, (T, 4, 2)))
    a = a * scale
    return _wht8_upper(tl.reshape(tl.join(tl.fma(b, scale, a), tl.fma(b, neg_scale, a)), (T, 8)), T)


@triton.jit
def wht32_scaled_in(x0, x1, x2, x3, scale, T: tl.constexpr):
    """H32 (entries +-1, unnormalized) of scale * the sub-blocks held as x0..x3."""
    x0 = _wht8_scaled(x0, scale, -scale, T)
    x1 = _wht8_scaled(x1, scale, -scale, T)
    x2 = _wht8_scaled(x2, scale, -scale, T)
    x3 = _wht8_scaled(x3, scale, -scale, T)
    y0 = x0 + x1
    y1 = x0 - x1
    y2 = x2 + x3
    y3 = x2 - x3
    return y0 + y2, y1 + y3, y0 - y2, y1 - y3


@triton.jit
def wht32_scaled_out(x0, x1, x2, x3, scale, T: tl.constexpr):
    """scale * H32 of the sub-blocks held as x0..x3, ``scale`` [T, 1] powers of two
    folded into the last stage as in ``_wht8_scaled`` (exact: no result is subnormal)."""
    x0 = _wht8(x0, T)
    x1 = _wht8(x1, T)
    x2 = _wht8(x2, T)
    x3 = _wht8(x3, T)
    y0 = (x0 + x1) * scale
    y1 = (x0 - x1) * scale
    y2 = x2 + x3
    y3 = x2 - x3
    neg_scale = -scale  # per sub-block, not per value
    return (tl.fma(y2, scale, y0), tl.fma(y3, scale, y1), tl.fma(y2, neg_scale, y0),
            tl.fma(y3, neg_scale, y1))


@triton.jit
def _per_sub(v, T: tl.constexpr):
    """[T // 8] per-block values -> [T] per-sub-block (each repeated 8 times)."""
    return tl.reshape(tl.broadcast_to(v[:, None], (T // 8, 8)), (T,))


@triton.jit
def _block_max(v, T: tl.constexpr):
    """[T] per-sub-block -> [T]: the max over each sub-block's block (8 lanes)."""
    return _per_sub(tl.max(tl.reshape(v, (T // 8, 8)), axis=1), T)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _sub_ratio(c):
    """Sub-scale code -> (c/63)^2, as reference.sub_ratio."""
    v = c.to(tl.float32) * INV63
    return v * v


@triton.jit
def _max_abs(y):
    return tl.max(tl.abs(y), axis=1)  # the abs folds into the max: no other use


@triton.jit
def _codes(y, inv, NV_SQRT: tl.constexpr):
    """Rotated values y [T, 8] and 1 / s_g [T] -> 6-bit codes [T, 8] (int32): the sign
    bit from y's bits (a -0.0 only occurs in an all-zero sub-block, whose codes the
    caller clears) and q = floor((sqrt(|y| / s_g + 9/16) - 3/4) * 63) <= 31 (|y| <= s_g;
    the reference's clamps to 1 and to 31 change nothing then)."""
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
    return q | ((y.to(tl.int32, bitcast=True) >> 26) & 32)


@triton.jit
def _pack(code, T: tl.constexpr):
    """8 codes per sub-block [T, 8] -> (nibble-plane word [T], their 16 high-plane bits
    [T]). Bytes of 4 codes first (even and odd columns), then nibble and 2-bit fields."""
    even, odd = tl.split(tl.reshape(code, (T, 4, 2)))
    at_byte = (8 * tl.arange(0, 4))[None, :]
    b_even = tl.sum(even << at_byte, axis=1)
    b_odd = tl.sum(odd << at_byte, axis=1)
    nib = (b_even & 0x0F0F0F0F) | ((b_odd & 0x0F0F0F0F) << 4)
    pairs = ((b_even >> 4) & 0x03030303) | ((b_odd >> 2) & 0x0C0C0C0C)  # codes 2k, 2k+1
    quads = pairs | (pairs >> 4)  # codes 4k..4k+3 in bits 0-7 and 16-23
    return nib, (quads & 0xFF) | ((quads >> 8) & 0xFF00)


@triton.jit
def encode_tile(x0, x1, x2, x3, T: tl.constexpr, NV_SQRT: tl.constexpr):
    """Sub-blocks x0..x3 (fp32, zeros where masked) -> packed payload words: nibble
    plane [T, 4] and high plane [T, 2] (int32), and each sub-block's block record [T]
    (int64, the same in the 8 sub-blocks of a block). ``NV_SQRT``: NVIDIA only."""
    # A block holding any non-zero x (tested on x: its rotation may round to 0).
    bits = (x0.to(tl.int32, bitcast=True) | x1.to(tl.int32, bitcast=True)) | (
        x2.to(tl.int32, bitcast=True) | x3.to(tl.int32, bitcast=True))
    nonzero = _block_max(tl.reduce(bits, 1, _bit_or) & 0x7FFFFFFF, T) > 0
    y0, y1, y2, y3 = wht32_scaled_in(x0, x1, x2, x3, NORM, T)
    sub_max = tl.maximum(tl.maximum(_max_abs(y0), _max_abs(y1)),
                         tl.maximum(_max_abs(y2), _max_abs(y3)))
    # A NaN x makes all 32 y NaN (a max skips NaN but returns it when all are), +-Inf
    # makes them +-Inf or NaN: the sub-block max is then not <= FP32_MAX. The block max
    # below would skip a NaN sub-block, so this is tested per sub-block.
    non_finite = _block_max((~(sub_max <= FP32_MAX)).to(tl.int32), T) > 0
    blk_max = _block_max(sub_max, T)
    # Round the block max up to bf16 so that no value clips.
    scale_bits = (blk_max.to(tl.int32, bitcast=True) + 0xFFFF) >> 16
    # Out of range (as in reference.encode): NaN/Inf, a scale beyond bf16, or too small.
    bad = non_finite | (scale_bits >= BF16_INF_BITS) | (nonzero & (blk_max < SCALE_MIN))
    scale_bits = tl.where(bad, 0, scale_bits)
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    sub_max = tl.minimum(sub_max, scale)
    # Smallest c with fp32(scale * (c/63)^2) >= sub_max: an estimate, then exact fix-ups.
    est = tl.where(scale > 0, tl.sqrt(sub_max / scale) * 63.0, 0.0)
    c = tl.minimum(tl.maximum(tl.ceil(est), 0.0), 63.0).to(tl.int32)
    c = tl.where(scale * _sub_ratio(c) < sub_max, c + 1, c)
    c = tl.where((c > 0) & (scale * _sub_ratio(tl.maximum(c - 1, 0)) >= sub_max), c - 1, c)
    c = tl.where(bad, 0, c)
    sub_scale = scale * _sub_ratio(c)
    inv = tl.where(sub_scale > 0, tl.math.div_rn(1.0, sub_scale), 0.0)
    n0, h0 = _pack(_codes(y0, inv, NV_SQRT), T)
    n1, h1 = _pack(_codes(y1, inv, NV_SQRT), T)
    n2, h2 = _pack(_codes(y2, inv, NV_SQRT), T)
    n3, h3 = _pack(_codes(y3, inv, NV_SQRT), T)
    # Codes 0 for blocks sent as NaN and for all-zero sub-blocks (c = 0, y = +-0).
    clear = (bad | (c == 0))[:, None]
    nib = tl.where(clear, 0, tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), (T, 4)))
    high = tl.where(clear, 0, tl.join(h0 | (h1 << 16), h2 | (h3 << 16)))
    g = tl.arange(0, T) % 8
    sub_bits = c.to(tl.int64) << (16 + 6 * g).to(tl.int64)
    # Disjoint bit fields: the sum is a bitwise OR.
    rec = _per_sub(tl.sum(tl.reshape(sub_bits, (T // 8, 8)), axis=1), T)
    return nib, high, rec | tl.where(bad, BF16_NAN_BITS, scale_bits).to(tl.int64)


@triton.jit
def _payload_ptrs(pay, row, j, subs_per_row, pay_row_bytes):
    """Word pointers of the tile's sub-blocks in a uint8 payload (row stride
    pay_row_bytes): nibble plane [T, 4] and high plane [T, 2] (int32), block record [T]
    (int64, one address per block)."""
    prow = pay + row.to(tl.int64) * pay_row_bytes
    nib = (prow + 16 * j).to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :]
    # The high plane starts at cols / 2 = 16 subs_per_row bytes, the records at 3 cols / 4.
    high = (prow + 16 * subs_per_row + 8 * j).to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 2)[None, :]
    rec = (prow + 24 * subs_per_row + 8 * (j // 8)).to(tl.pointer_type(tl.int64))
    return nib, high, rec


@triton.jit
def store_payload(pay, row, j, ok, subs_per_row, pay_row_bytes, nib, high, rec):
    """Store ``encode_tile``'s words (each record once, by the block's first sub-block)."""
    nib_ptrs, high_ptrs, rec_ptrs = _payload_ptrs(pay, row, j, subs_per_row, pay_row_bytes)
    tl.store(nib_ptrs, nib, mask=ok[:, None])
    tl.store(high_ptrs, high, mask=ok[:, None])
    tl.store(rec_ptrs, rec, mask=ok & (j % 8 == 0))


@triton.jit
def _dequantize(nib, h16, sub_scale, levels, mags, GATHER: tl.constexpr):
    """The 8 codes of one nibble word nib [T] and their high bits h16 [T] -> [T, 8]
    values levels[code] * s_g. GATHER: picked from mags ([32, 8], the 32 non-negative
    levels in every column) and signed by code bit 5 (bit 2 col + 1 of h16); else read
    from the 64-entry table ``levels`` in global memory."""
    col = tl.arange(0, 8)[None, :]
    if GATHER:
        q = ((nib[:, None] >> (4 * col)) & 15) | (((h16 << 4)[:, None] >> (2 * col)) & 0x10)
        sign = (h16[:, None] << (30 - 2 * col)) & (-2147483648)
        v = (tl.gather(mags, q, 0).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
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
    nib_ptrs, high_ptrs, rec_ptrs = _payload_ptrs(pay, row, j, subs_per_row, pay_row_bytes)
    nib = tl.load(nib_ptrs, mask=ok[:, None], other=0)
    high = tl.load(high_ptrs, mask=ok[:, None], other=0)
    rec = tl.load(rec_ptrs, mask=ok, other=0)
    scale_bits = (rec & 0xFFFF).to(tl.int32)
    c = ((rec >> (16 + 6 * (j % 8)).to(tl.int64)) & 63).to(tl.int32)
    sub_scale = (scale_bits << 16).to(tl.float32, bitcast=True) * _sub_ratio(c)
    words02, words13 = tl.split(tl.reshape(nib, (nib.shape[0], 2, 2)))
    n0, n2 = tl.split(words02)
    n1, n3 = tl.split(words13)
    h01, h23 = tl.split(high)  # the high bits of x0, x1 and of x2, x3
    mags = levels  # unused without GATHER
    if GATHER:
        mags = tl.broadcast_to(tl.load(levels + tl.arange(0, 32))[:, None], (32, 8))
    a0 = _dequantize(n0, h01, sub_scale, levels, mags, GATHER)
    a1 = _dequantize(n1, h01 >> 16, sub_scale, levels, mags, GATHER)
    a2 = _dequantize(n2, h23, sub_scale, levels, mags, GATHER)
    a3 = _dequantize(n3, h23 >> 16, sub_scale, levels, mags, GATHER)
    return a0, a1, a2, a3, scale_bits


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
    poison = (_block_max(over, T) > 0)[:, None]
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
    x0, x1, x2, x3 = wht32_scaled_out(a0, a1, a2, a3, post, T)
    if OUT_DTYPE == tl.float16:  # 65504: any block may overflow
        x0, x1, x2, x3 = _poison_overflow(x0, x1, x2, x3, OUT_DTYPE, T)
    else:
        if any_big:
            x0, x1, x2, x3 = _poison_overflow(x0, x1, x2, x3, OUT_DTYPE, T)
    return x0.to(OUT_DTYPE), x1.to(OUT_DTYPE), x2.to(OUT_DTYPE), x3.to(OUT_DTYPE)
