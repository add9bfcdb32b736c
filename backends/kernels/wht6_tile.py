"""Per-tile math of the wht6 codec as @triton.jit helpers, shared by every kernel that
reads or writes wht6 payloads (encode, decode, decode_accumulate, and a fused one-shot
all-reduce that encodes into a peer buffer and decodes peers' payloads in one kernel).

The wire format is specified in ``backends/wht6/__init__.py`` and, operation by
operation, in ``backends/wht6/reference.py``; these helpers perform the same fp32
operations in the same order. Launch the kernels with ``enable_fp_fusion=False`` so
no multiply-add is contracted into an fma the reference does not do.

A tile is T sub-blocks (T a multiple of 8) taken in row-major order over the whole
tensor: flat sub-block f is row f // subs_per_row, sub-block f % subs_per_row of that
row. As cols is a multiple of 256, tile rows 8k..8k+7 are exactly one block.

Helpers (a kernel needs only the first five):
  subblock_ptrs(base, f0, n_sub, subs_per_row, row_stride, T) -> (ptrs [T, 32], mask [T, 32])
  payload_ptrs(pay, f0, n_sub, subs_per_row, row_w64, T)
      -> (nib_ptrs [T, 4] *i32, high_ptrs [T, 2] *i32, rec_ptrs [T//8] *i64, sub_mask [T], blk_mask [T//8])
  encode_tile(x, T, SPLITS, DOT_FP32) -> (nib [T, 4] i32, high [T, 2] i32, rec [T//8] i64)
  load_dequantize(pay, f0, n_sub, subs_per_row, row_w64, T)
      -> [T, 32] fp32 rotated values times HEADROOM (1/8): sum up to 8 of these with +=
  decode_tile(acc, OUT_DTYPE, T, SPLITS, DOT_FP32) -> [T, 32] OUT_DTYPE: the inverse
      rotation of such a sum, rounded once; a block that overflows OUT_DTYPE is NaN
  quantize(y, nonzero, T), dequantize(nib, high, rec, T): the codec's two halves

Range: a rotation shifts each row by a power of two before the products (2**-5 for a
row max >= 2**64, 2**64 for one below 2**-64) and back after the sums, so no partial
sum overflows and the bf16 pieces of a row's significant values are normal numbers
(a subnormal bf16 piece drops bits, and the Triton interpreter misconverts it). The shifts
are exact: results equal the unshifted fp32 computation wherever that neither
overflows nor goes subnormal, so on ordinary data the bits are those of a plain
rotation. The encoder shifts every row (the row max also tells it which blocks are
non-zero); the decoder shifts only in tiles holding a value the shifts could change
(a per-row shift there cost 15% of decode_accumulate's time on the H200, the tile
test 4%; in the encoder the row max costs 10% either way).
"""
import triton
import triton.language as tl

from backends.wht6 import reference

FP32_MAX = tl.constexpr(3.4028234663852886e38)
SCALE_MIN = tl.constexpr(reference.SCALE_MIN)
HEADROOM = tl.constexpr(reference.HEADROOM)
UNHEADROOM = tl.constexpr(1.0 / reference.HEADROOM)
BF16_INF_BITS = tl.constexpr(0x7F80)
BF16_NAN_BITS = tl.constexpr(0x7FC0)
FP32_NAN_BITS = tl.constexpr(0x7FC00000)
INV63 = tl.constexpr(reference.INV63)  # rounded to fp32 where used, as in reference.INV63
NORM = tl.constexpr(1.0 / reference.SUB)  # the forward rotation is H32 / 32
# Row shifts of ``_rotate_shifted`` (module doc): rows at or above ROW_BIG are scaled
# down by 2**-5 (32 terms of at most the fp32 max then sum to at most the fp32 max),
# rows below ROW_SMALL up by 2**64 (subnormal values become normal).
ROW_BIG = tl.constexpr(2.0**64)
ROW_SMALL = tl.constexpr(2.0**-64)
SHIFT_DOWN = tl.constexpr(2.0**-5)
SHIFT_UP = tl.constexpr(2.0**64)
UNSHIFT_DOWN = tl.constexpr(2.0**5)
UNSHIFT_UP = tl.constexpr(2.0**-64)


@triton.jit
def subblock_ptrs(base, f0, n_sub, subs_per_row, row_stride, T: tl.constexpr):
    """Pointers to T sub-blocks (32 values each) of a row-major tensor, starting at flat
    sub-block f0, and the mask of those inside the tensor (n_sub sub-blocks in all)."""
    f = f0 + tl.arange(0, T).to(tl.int64)
    row = f // subs_per_row
    col = (f % subs_per_row) * 32
    offs = row[:, None] * row_stride + col[:, None] + tl.arange(0, 32)[None, :]
    mask = (f < n_sub)[:, None] & (tl.arange(0, 32) < 32)[None, :]
    return base + offs, mask


@triton.jit
def payload_ptrs(pay, f0, n_sub, subs_per_row, row_w64, T: tl.constexpr):
    """Word pointers into a uint8 payload (row stride row_w64 int64 words) for the T
    sub-blocks from flat sub-block f0: their nibble-plane words, high-plane words, and
    the int64 records of their T // 8 blocks; plus the masks of those that exist."""
    f = f0 + tl.arange(0, T).to(tl.int64)
    row = f // subs_per_row
    j = f % subs_per_row
    w32 = pay.to(tl.pointer_type(tl.int32)) + row * (2 * row_w64)
    nib_ptrs = w32[:, None] + (4 * j)[:, None] + tl.arange(0, 4)[None, :]
    # The high plane starts at cols / 2 bytes = 4 * subs_per_row words.
    high_ptrs = w32[:, None] + (4 * subs_per_row + 2 * j)[:, None] + tl.arange(0, 2)[None, :]
    b = f0 // 8 + tl.arange(0, T // 8).to(tl.int64)
    blocks_per_row = subs_per_row // 8
    # The records start at 3 cols / 4 bytes = 3 * subs_per_row int64 words.
    rec_ptrs = (pay.to(tl.pointer_type(tl.int64)) + (b // blocks_per_row) * row_w64
                + 3 * subs_per_row + b % blocks_per_row)
    return nib_ptrs, high_ptrs, rec_ptrs, f < n_sub, b * 8 < n_sub


@triton.jit
def hadamard32(DTYPE: tl.constexpr):
    """H32[i, j] = (-1)^popcount(i & j), as a [32, 32] tile of DTYPE."""
    i = tl.arange(0, 32)[:, None]
    j = tl.arange(0, 32)[None, :]
    p = i & j
    p = p ^ (p >> 1)
    p = p ^ (p >> 2)
    p = p ^ (p >> 4)
    # Through fp32: the interpreter converts int -> bf16 wrongly.
    return (1.0 - 2.0 * (p & 1).to(tl.float32)).to(DTYPE)


@triton.jit
def _dot_h(piece, h, acc, DOT_FP32: tl.constexpr):
    # DOT_FP32 is the Triton interpreter's path (its bf16 dot is wrong). It sums in fp64
    # (the 32 products of +-1 and a bf16 value sum exactly unless they span over 2**40;
    # adding the fp32 acc is one rounding) and rounds once to fp32. numpy's fp32 matmul
    # rounds in an order that depends on the tile's row count (BLAS kernels differ), which
    # made the fused one-shot kernel (64 sub-blocks a tile) and decode_accumulate (16)
    # differ by an ulp (numpy 2.4).
    if DOT_FP32:
        return tl.dot(piece.to(tl.float64), h.to(tl.float64), acc.to(tl.float64),
                      input_precision="ieee").to(tl.float32)
    return tl.dot(piece, h, acc)


@triton.jit
def _wht32(v, SPLITS: tl.constexpr, DOT_FP32: tl.constexpr):
    """H32 @ each row of v ([T, 32] fp32), on tensor cores: v is split into SPLITS bf16
    pieces (v = hi + lo + lo2 exactly for SPLITS = 3; 1 suffices for bf16 input, 2 for
    fp16) whose products with +-1 are exact; the sums accumulate in fp32."""
    h = hadamard32(tl.bfloat16)
    hi = v.to(tl.bfloat16)
    y = _dot_h(hi, h, tl.zeros(v.shape, tl.float32), DOT_FP32)
    if SPLITS >= 2:
        rest = v - hi.to(tl.float32)
        lo = rest.to(tl.bfloat16)
        y = _dot_h(lo, h, y, DOT_FP32)
        if SPLITS >= 3:
            y = _dot_h((rest - lo.to(tl.float32)).to(tl.bfloat16), h, y, DOT_FP32)
    return y


@triton.jit
def _extreme(v):
    """Whether any value of the tile v may need a row shift: |v| >= ROW_BIG, or
    0 < |v| < ROW_SMALL (a scalar: tiles without one take the plain rotation)."""
    a = tl.abs(v)
    return tl.max(((a >= ROW_BIG) | ((a < ROW_SMALL) & (a > 0))).to(tl.int32)) > 0


@triton.jit
def _rotate_shifted(v, m, POST: tl.constexpr, SPLITS: tl.constexpr, DOT_FP32: tl.constexpr):
    """H32 @ each row of v ([T, 32] fp32) times POST (a power of two), given m = max |v|
    of each row, with the row shifts of the module doc: finite wherever the exact result
    is; equal to the plain _wht32(v) * POST on rows that need no shift."""
    big = m >= ROW_BIG
    small = m < ROW_SMALL
    pre = tl.where(big, SHIFT_DOWN, tl.where(small, SHIFT_UP, 1.0))
    post = tl.where(big, UNSHIFT_DOWN, tl.where(small, UNSHIFT_UP, 1.0)) * POST
    return _wht32(v * pre[:, None], SPLITS, DOT_FP32) * post[:, None]


@triton.jit
def _per_sub(v, T: tl.constexpr):
    """[T // 8] per-block values -> [T] per-sub-block (each repeated 8 times)."""
    return tl.reshape(tl.broadcast_to(v[:, None], (T // 8, 8)), (T,))


@triton.jit
def _any_per_block(flag, T: tl.constexpr):
    """[T] per-sub-block flags -> [T // 8]: any of the block's 8."""
    return tl.max(tl.reshape(flag.to(tl.int32), (T // 8, 8)), axis=1) > 0


@triton.jit
def _sub_ratio(c):
    """Sub-scale code -> (c/63)^2, as reference.sub_ratio."""
    v = c.to(tl.float32) * INV63
    return v * v


@triton.jit
def quantize(y, nonzero, T: tl.constexpr):
    """Rotated sub-blocks y [T, 32] fp32 (8 consecutive rows = one block; normalized,
    H32 x / 32) and per-block flags ``nonzero`` [T // 8] (the block's x has a non-zero
    value) -> packed nibble words [T, 4], high words [T, 2] (int32) and block records
    [T // 8] (int64)."""
    mag = tl.abs(y)
    finite = mag <= FP32_MAX  # False for NaN and +-Inf
    sub_max = tl.max(tl.where(finite, mag, 0.0), axis=1)
    blk_max = tl.max(tl.reshape(sub_max, (T // 8, 8)), axis=1)
    # Round the block max up to bf16 so that no value clips.
    scale_bits = (blk_max.to(tl.int32, bitcast=True) + 0xFFFF) >> 16
    # Out of range (as in reference.encode): NaN/Inf, a scale beyond bf16, or too small.
    bad = (_any_per_block(tl.min(finite.to(tl.int32), axis=1) == 0, T) | (scale_bits >= BF16_INF_BITS)
           | (nonzero & (blk_max < SCALE_MIN)))
    scale_bits = tl.where(bad, 0, scale_bits)
    scale = _per_sub((scale_bits << 16).to(tl.float32, bitcast=True), T)
    sub_max = tl.minimum(sub_max, scale)
    # Smallest c with fp32(scale * (c/63)^2) >= sub_max: an estimate, then exact fix-ups.
    est = tl.where(scale > 0, tl.sqrt(sub_max / scale) * 63.0, 0.0)
    c = tl.minimum(tl.maximum(tl.ceil(est), 0.0), 63.0).to(tl.int32)
    c = tl.where(scale * _sub_ratio(c) < sub_max, c + 1, c)
    c = tl.where((c > 0) & (scale * _sub_ratio(tl.maximum(c - 1, 0)) >= sub_max), c - 1, c)
    sub_scale = scale * _sub_ratio(c)
    inv = tl.where(sub_scale > 0, tl.math.div_rn(1.0, sub_scale), 0.0)
    u = tl.minimum(tl.where(finite, mag, 0.0) * inv[:, None], 1.0)
    q = tl.floor((tl.sqrt_rn(u + 0.5625) - 0.75) * 63.0)
    code = tl.minimum(tl.maximum(q, 0.0), 31.0).to(tl.int32) | tl.where(y < 0, 32, 0)
    code = tl.where(_per_sub(bad, T)[:, None], 0, code)
    nib_bits = tl.reshape(code & 15, (T, 4, 8)) << (4 * tl.arange(0, 8))[None, None, :]
    high_bits = tl.reshape((code >> 4) & 3, (T, 2, 16)) << (2 * tl.arange(0, 16))[None, None, :]
    sub_bits = tl.reshape(c.to(tl.int64), (T // 8, 8)) << (16 + 6 * tl.arange(0, 8).to(tl.int64))[None, :]
    rec = tl.sum(sub_bits, axis=1) | tl.where(bad, BF16_NAN_BITS, scale_bits).to(tl.int64)
    # Disjoint bit fields: the sums are bitwise ORs.
    return tl.sum(nib_bits, axis=2), tl.sum(high_bits, axis=2), rec


@triton.jit
def encode_tile(x, T: tl.constexpr, SPLITS: tl.constexpr, DOT_FP32: tl.constexpr):
    """Input sub-blocks x [T, 32] fp32 (zeros where masked) -> their packed payload words,
    as ``quantize``."""
    m = tl.max(tl.abs(x), axis=1)
    return quantize(_rotate_shifted(x, m, NORM, SPLITS, DOT_FP32), _any_per_block(m > 0, T), T)


@triton.jit
def dequantize(nib, high, rec, T: tl.constexpr):
    """Packed words of T sub-blocks -> their values in the rotated domain times HEADROOM,
    [T, 32] fp32 (the factor goes on the exact level, so the product rounds once)."""
    low = tl.reshape((nib[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 15, (T, 32))
    top = tl.reshape((high[:, :, None] >> (2 * tl.arange(0, 16))[None, None, :]) & 3, (T, 32))
    code = low | (top << 4)
    scale = ((rec & 0xFFFF).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    c = (rec[:, None] >> (16 + 6 * tl.arange(0, 8).to(tl.int64))[None, :]) & 63
    sub_scale = _per_sub(scale, T) * _sub_ratio(tl.reshape(c, (T,)))
    t = (2 * (code & 31) + 1).to(tl.float32) * INV63
    v = t * (3.0 + t) * 0.25 * HEADROOM * sub_scale[:, None]
    return tl.where(code >= 32, -v, v)


@triton.jit
def load_dequantize(pay, f0, n_sub, subs_per_row, row_w64, T: tl.constexpr):
    """Load T sub-blocks of a payload from flat sub-block f0 and dequantize them."""
    nib_ptrs, high_ptrs, rec_ptrs, sub_mask, blk_mask = payload_ptrs(pay, f0, n_sub, subs_per_row, row_w64, T)
    nib = tl.load(nib_ptrs, mask=sub_mask[:, None], other=0)
    high = tl.load(high_ptrs, mask=sub_mask[:, None], other=0)
    rec = tl.load(rec_ptrs, mask=blk_mask, other=0)
    return dequantize(nib, high, rec, T)


@triton.jit
def _poison_overflow(x, OUT_DTYPE: tl.constexpr, T: tl.constexpr):
    """x [T, 32] fp32 with every block holding a value that rounds to +-Inf in OUT_DTYPE
    set to NaN (as reference.poison_overflow)."""
    over = tl.abs(x.to(OUT_DTYPE).to(tl.float32)) > FP32_MAX
    bad = _per_sub(_any_per_block(tl.max(over.to(tl.int32), axis=1) > 0, T), T)
    nan = tl.full(x.shape, FP32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(bad[:, None], nan, x)


@triton.jit
def decode_tile(acc, OUT_DTYPE: tl.constexpr, T: tl.constexpr, SPLITS: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """A sum of ``load_dequantize`` tiles [T, 32] -> the decoded values in OUT_DTYPE:
    x = H32 @ acc / HEADROOM, rounded once; every block holding a value that rounds to
    +-Inf in OUT_DTYPE is all NaN."""
    if _extreme(acc):
        x = _rotate_shifted(acc, tl.max(tl.abs(acc), axis=1), UNHEADROOM, SPLITS, DOT_FP32)
        x = _poison_overflow(x, OUT_DTYPE, T)
    else:
        x = _wht32(acc, SPLITS, DOT_FP32) * UNHEADROOM
        if OUT_DTYPE == tl.float16:  # |acc| < ROW_BIG: |x| < 2**72 fits fp32 and bf16
            x = _poison_overflow(x, OUT_DTYPE, T)
    return x.to(OUT_DTYPE)
