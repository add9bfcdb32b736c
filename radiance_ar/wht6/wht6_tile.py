"""Per-tile math of the wht6 codec as @triton.jit helpers, shared by every kernel that
reads or writes wht6 payloads (encode, decode-accumulate, and the fused one-shot
all-reduce that encodes into a peer buffer and decodes peers' payloads in one kernel).

The wire format is specified in ``radiance_ar/wht6/__init__.py`` and, operation by
operation, in ``radiance_ar/wht6/reference.py``. Launch the kernels with
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
(Why not tensor cores: the layout changes and shuffles around a rotation by ``tl.dot``
cost encode 117 SASS instructions per value, against 23.4 here: ``radiance_ar.diagnostics.sass_count``,
an offline sm_90 compile of the path every program runs.)

Rotation: H32 = H4 (over a) (x) H8 (over the 8 columns of x_a): three butterfly stages
inside each x_a, two across them: 5 fp32 adds per value, in one fixed order, so every
kernel using these helpers rotates to the same bits. The reference sums exactly and
rounds once; a butterfly rounds where a partial sum needs more than 24 bits, so a
rotated value may differ from the reference's by an fp32 rounding (module doc of
``reference.py``): bf16 inputs spanning less than 2**16 rotate exactly.

Encode and decode math: ``wht6_tile_encode`` and ``wht6_tile_decode``.

Helpers:
  tile_of(pid, T, n_sub, subs_per_row) -> (row, j, ok): the tile's sub-blocks
  load_values(base, row, j, ok, row_stride, cols, PADDED) -> x0..x3 [T, 8] fp32
  load_bf16_words(base, row, j, ok, row_stride) -> x0..x3, nz (bf16 read as words)
  store_values(base, row, j, ok, row_stride, cols, x0..x3, PADDED)
  wht32_scaled_in / wht32_scaled_out: the rotation, a power-of-two scale folded in
  per_sub, block_max, bit_or, sub_ratio: per-block reductions and the sub-scale ratio
  payload_ptrs, store_payload: where a tile's payload words lie, and their store
"""
import functools

import triton
import triton.language as tl

from radiance_ar.wht6 import reference

INV63 = tl.constexpr(reference.INV63)  # rounded to fp32 where used, as in reference.INV63


@triton.jit
def tile_of(pid, T: tl.constexpr, n_sub, subs_per_row, CLAMP: tl.constexpr = False,
            row_magic=None, row_shift=None):
    """Row and in-row index j (int32) of the T sub-blocks of tile ``pid``, and which of
    them exist (n_sub sub-blocks in all; callers check n_sub < 2**31). ``CLAMP``: the
    sub-blocks past the end get the last one's row and j (so that they can be read
    without a mask; n_sub is a multiple of 8, so they fill whole blocks of their own).
    ``row_magic``, ``row_shift``: ``row_divisor(subs_per_row)``, the division by
    subs_per_row as a multiply-high and a shift."""
    f = pid * T + tl.arange(0, T)
    ok = f < n_sub
    if CLAMP:
        f = tl.minimum(f, n_sub - 1)
    if row_magic is None:
        # Unsigned (f, subs_per_row >= 0): a shorter division than the signed one.
        row = (f.to(tl.uint32) // subs_per_row.to(tl.uint32)).to(tl.int32)
    else:
        row = (tl.umulhi(f.to(tl.uint32), row_magic.to(tl.uint32, bitcast=True))
               >> row_shift.to(tl.uint32)).to(tl.int32)
    return row, f - row * subs_per_row, ok


@functools.cache
def row_divisor(d: int) -> tuple:
    """(magic, shift) with f // d == umulhi(f, magic) >> shift for all 0 <= f < 2**31
    (magic as the int32 of its uint32 bits), for 2 <= d < 2**31. Granlund-Montgomery
    with 31-bit dividends: l = ceil(log2 d), m = floor(2**(31 + l) / d) + 1, so 2**(31+l)
    < m d <= 2**(31+l) + 2**l, so floor(f m / 2**(31+l)) = floor(f / d) for f < 2**31;
    and m < 2**32."""
    if not 2 <= d < 2**31:
        raise ValueError(f"divisor {d} out of range")
    l = (d - 1).bit_length()
    m = (1 << (31 + l)) // d + 1
    assert 0 < m < 2**32 and l >= 1
    return m - 2**32 if m >= 2**31 else m, l - 1


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
def load_bf16_words(base, row, j, ok, row_stride):
    """``load_values`` for bf16 with 4-byte aligned rows, read as 32-bit words (a bf16 is
    the high half of its fp32: the even column is a word's low half shifted up, the odd
    one the word with its low half cleared), and the OR of each sub-block's words without
    sign bits (non-zero iff a value is: ``encode_tile``'s ``nz``). Masked sub-blocks are
    not read: their lanes compute values that are never stored."""
    ptrs = ((base + row.to(tl.int64) * row_stride + j * 32).to(tl.pointer_type(tl.int32))[:, None]
            + tl.arange(0, 4)[None, :])
    if ok is None:  # every sub-block exists (``tile_of``'s CLAMP): no mask
        w0 = tl.load(ptrs)
        w1 = tl.load(ptrs + 4)
        w2 = tl.load(ptrs + 8)
        w3 = tl.load(ptrs + 12)
    else:
        w0 = tl.load(ptrs, mask=ok[:, None])
        w1 = tl.load(ptrs + 4, mask=ok[:, None])
        w2 = tl.load(ptrs + 8, mask=ok[:, None])
        w3 = tl.load(ptrs + 12, mask=ok[:, None])
    nz = tl.reduce((w0 | w1) | (w2 | w3), 1, bit_or) & 0x7FFF7FFF
    return _bf16_pairs(w0), _bf16_pairs(w1), _bf16_pairs(w2), _bf16_pairs(w3), nz


@triton.jit
def _bf16_pairs(w):
    """[T, 4] words of two bf16 -> [T, 8] fp32 (low half first)."""
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (w.shape[0], 8))


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
def per_sub(v, T: tl.constexpr):
    """[T // 8] per-block values -> [T] per-sub-block (each repeated 8 times)."""
    return tl.reshape(tl.broadcast_to(v[:, None], (T // 8, 8)), (T,))


@triton.jit
def block_max(v, T: tl.constexpr):
    """[T] per-sub-block -> [T]: the max over each sub-block's block (8 lanes)."""
    return per_sub(tl.max(tl.reshape(v, (T // 8, 8)), axis=1), T)


@triton.jit
def bit_or(a, b):
    return a | b


@triton.jit
def sub_ratio(c):
    """Sub-scale code -> (c/63)^2, as reference.sub_ratio."""
    v = c.to(tl.float32) * INV63
    return v * v


@triton.jit
def payload_ptrs(pay, row, j, subs_per_row, pay_row_bytes):
    """Word pointers of the tile's sub-blocks in a uint8 payload (row stride
    pay_row_bytes): nibble plane [T, 4] and high plane [T, 2] (int32), block record [T]
    (int64, one address per block)."""
    prow = pay + row.to(tl.int64) * pay_row_bytes
    # Offsets in a row as uint32 (non-negative and below 2**31: no sign extension).
    ju = j.to(tl.uint32, bitcast=True)
    spr = subs_per_row.to(tl.uint32, bitcast=True)
    nib = (prow + 16 * ju).to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :]
    # The high plane starts at cols / 2 = 16 subs_per_row bytes, the records at 3 cols / 4.
    high = (prow + (16 * spr + 8 * ju)).to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 2)[None, :]
    rec = (prow + (24 * spr + (ju & 0xFFFFFFF8))).to(tl.pointer_type(tl.int64))  # 8 (j // 8)
    return nib, high, rec


@triton.jit
def store_payload(pay, row, j, ok, subs_per_row, pay_row_bytes, nib, high, rec):
    """Store ``encode_tile``'s words (each record once, by the block's first sub-block)."""
    nib_ptrs, high_ptrs, rec_ptrs = payload_ptrs(pay, row, j, subs_per_row, pay_row_bytes)
    tl.store(nib_ptrs, nib, mask=ok[:, None])
    tl.store(high_ptrs, high, mask=ok[:, None])
    tl.store(rec_ptrs, rec, mask=ok & ((j & 7) == 0))
