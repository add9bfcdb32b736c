"""The wht6 wire format in plain torch: the specification in code (CPU or any device).

The format itself is documented in ``radiance_ar/wht6/__init__.py``. This module is the
reference the Triton kernels are tested against, so it spells every fp32 operation
in the order the kernels perform it: codes and scales depend on nothing but IEEE fp32
rounding of the same operations. The one exception is the rotation: here the 32-term
sums are formed exactly (float64) and rounded once to fp32, while a kernel accumulates
in fp32 in its own order, so a kernel may differ from this module by an fp32 rounding
of a rotated value (a code can move by one step when that lands on a decision edge).
The format constants below are the single definition (``radiance_ar.wht6`` exports them).
"""
import sys

import torch

SUB = 32  # values per Walsh-Hadamard rotation (one sub-block)
GROUP = 8  # sub-blocks per block (they share one bf16 scale)
BLOCK = SUB * GROUP  # 256 values: the unit of the format; cols must be a multiple
BLOCK_BYTES = 200  # 256 codes x 6 bits + 8-byte scale record: 6.25 bits/value
MAG_LEVELS = 32  # code magnitudes; the sign bit doubles them to 64 levels
# Smallest block scale: with S >= 2**-114 every sub-scale S * (c/63)^2 (c >= 1) is a
# normal fp32 number (>= 2**-125.95), so 1 / s_g is finite and exact to fp32. A non-zero
# block whose rotated max is smaller is out of range and sent as NaN.
SCALE_MIN = 2.0**-114
# The decoder sums dequantized values times 1/8: a sum of up to 8 payloads (|y| <= S <=
# the bf16 max each) cannot overflow fp32, and the inverse rotation multiplies by 8.
HEADROOM = 0.125
_FP32_MAX = torch.finfo(torch.float32).max
_BF16_NAN_BITS = 0x7FC0  # the scale of a block that held NaN/Inf (decodes to NaN)
_BF16_INF_BITS = 0x7F80

if sys.byteorder != "little":  # the scale record is defined as a little-endian int64
    raise ImportError("radiance_ar.wht6 supports little-endian hosts only")


def padded_cols(cols: int) -> int:
    """``cols`` rounded up to whole blocks: a kernel that takes any ``cols`` (the fused
    one-shot all-reduce) codes a row as if zero-padded to this width."""
    return -(-cols // BLOCK) * BLOCK


def payload_bytes_per_row(cols: int) -> int:
    """Bytes of one payload row (nibble plane, high-bit plane, then scale records) of
    ``cols`` values, zero-padded to whole blocks (:func:`padded_cols`)."""
    return padded_cols(cols) // BLOCK * BLOCK_BYTES


def plane_offsets(cols: int) -> tuple:
    """Byte offsets inside a payload row of (nibble plane, high-bit plane, records)."""
    return 0, cols // 2, 3 * cols // 4


def hadamard(n: int = SUB, dtype=torch.float64, device=None) -> torch.Tensor:
    """Unnormalized Sylvester-Hadamard matrix H (entries +-1, H @ H = n * I)."""
    idx = torch.arange(n, device=device)
    parity = torch.zeros(n, n, dtype=torch.int64, device=device)
    anded = idx[:, None] & idx[None, :]
    for bit in range(max(n.bit_length() - 1, 0)):
        parity ^= (anded >> bit) & 1
    return (1 - 2 * parity).to(dtype)


def rotate(v: torch.Tensor) -> torch.Tensor:
    """H @ each 32-vector along the last dim (unnormalized), summed exactly in float64.
    The format's forward rotation is rotate(x) / 32, its inverse rotate(y)."""
    return v.to(torch.float64) @ hadamard(SUB, device=v.device)


INV63 = 1.0 / 63.0  # used as fp32(1/63): a multiply, cheaper in kernels than a division


def sub_ratio(c: torch.Tensor) -> torch.Tensor:
    """Sub-scale code c (0..63) -> fraction (c/63)^2 of the block scale, fp32.

    Quadratic, not linear: a sub-block 1000x below its block's max (next to a massive
    activation) still gets a scale that fits it (down to 1/3969 of the block scale),
    at the price of 2-3% steps near the top instead of 1.6% (Gaussian error +0.7%)."""
    v = c.to(torch.float32) * INV63
    return v * v


def level(q: torch.Tensor) -> torch.Tensor:
    """Code magnitude q (0..31) -> level in units of the sub-block scale, fp32.

    t = (2q+1)/63 is uniform in (0, 1]; the level t(3+t)/4 is denser near zero
    (slope 3/4 there, 5/4 at the top) and 1 (to fp32 rounding) for q = 31."""
    t = (2 * q + 1).to(torch.float32) * INV63
    return t * (3.0 + t) * 0.25


def signed_levels(factor: float = 1.0) -> torch.Tensor:
    """fp32 value of each 6-bit code 0..63 in units of the sub-block scale, times
    ``factor`` (a power of two): ``+-level(code & 31) * factor``, negative from code 32 on.
    ``dequantize`` computes exactly these products (the kernels read them from a table)."""
    code = torch.arange(2 * MAG_LEVELS)
    v = level(code & (MAG_LEVELS - 1)) * factor
    return torch.where(code >= MAG_LEVELS, -v, v)


def quantize_magnitude(u: torch.Tensor) -> torch.Tensor:
    """|y|/scale in [0, 1] -> code magnitude 0..31 (inverse compander, then floor).

    t = 2(sqrt(u + 9/16) - 3/4) inverts u = t(3+t)/4; the decision edges sit at
    t = k/31.5, halfway between neighbouring level positions t_q = (2q+1)/63."""
    q = torch.floor((torch.sqrt(u + 0.5625) - 0.75) * 63.0)
    return q.clamp(0.0, MAG_LEVELS - 1).to(torch.int32)


def _check_cols(cols: int) -> None:
    if cols <= 0 or cols % BLOCK:
        raise ValueError(f"cols must be a positive multiple of {BLOCK}, got {cols}")


def encode(x: torch.Tensor) -> torch.Tensor:
    """[rows, cols] float tensor -> uint8 payload [rows, payload_bytes_per_row(cols)]."""
    rows, cols = x.shape
    _check_cols(cols)
    nsub, nblk = cols // SUB, cols // BLOCK
    xs = x.reshape(rows, nsub, SUB)
    # Normalized rotation (H / 32): |y| <= max |x|, so a finite x never overflows here.
    y = (rotate(xs) / SUB).to(torch.float32)
    mag = y.abs()
    finite = mag <= _FP32_MAX  # False for NaN and +-Inf
    sub_max = torch.where(finite, mag, 0.0).amax(-1)  # [rows, nsub]
    blk_max = sub_max.reshape(rows, nblk, GROUP).amax(-1)
    # Round the block max UP to bf16 so that every |y| <= scale: nothing clips.
    scale_bits = (blk_max.view(torch.int32) + 0xFFFF) >> 16
    # Out of range: NaN/Inf anywhere, a scale above the bf16 max, or a non-zero block
    # (tested on x: its rotation may round to 0) whose max is below SCALE_MIN.
    nonzero = (xs != 0).reshape(rows, nblk, BLOCK).any(-1)
    bad = (~finite.reshape(rows, nblk, BLOCK).all(-1) | (scale_bits >= _BF16_INF_BITS)
           | (nonzero & (blk_max < SCALE_MIN)))
    scale_bits = torch.where(bad, 0, scale_bits)
    scale = (scale_bits << 16).view(torch.float32)
    # A bad block (scale 0) gets sub-block maxima 0, as in the kernels; elsewhere a no-op.
    sub_max = torch.minimum(sub_max, scale.repeat_interleave(GROUP, dim=1))
    # Sub-scale code: the smallest c whose fp32(scale * (c/63)^2) covers the sub-block max.
    steps = scale[..., None] * sub_ratio(torch.arange(64, device=x.device))
    sub_code = torch.searchsorted(steps.contiguous(), sub_max.reshape(rows, nblk, GROUP).contiguous())
    sub_code = torch.where(bad[..., None], 0, sub_code).reshape(rows, nsub)
    sub_scale = scale.repeat_interleave(GROUP, dim=1) * sub_ratio(sub_code)
    inv = torch.where(sub_scale > 0, 1.0 / sub_scale, 0.0)
    u = (torch.where(finite, mag, 0.0) * inv[..., None]).clamp(max=1.0)
    code = quantize_magnitude(u) | ((y < 0).to(torch.int32) << 5)
    code = torch.where(bad.repeat_interleave(GROUP, dim=1)[..., None], 0, code)
    scale_bits = torch.where(bad, _BF16_NAN_BITS, scale_bits)
    return pack(code, sub_code, scale_bits)


def pack(code: torch.Tensor, sub_code: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """codes [rows, nsub, 32], sub-scale codes [rows, nsub], bf16 scale bits [rows, nblk]
    -> uint8 payload rows (layout in the package docstring)."""
    rows, nsub, _ = code.shape
    code = code.to(torch.int32)
    nib = (code[..., 0::2] & 15) | ((code[..., 1::2] & 15) << 4)  # [rows, nsub, 16]
    top = (code >> 4) & 3
    high = top[..., 0::4] | (top[..., 1::4] << 2) | (top[..., 2::4] << 4) | (top[..., 3::4] << 6)
    shifts = 16 + 6 * torch.arange(GROUP, device=code.device)
    nblk = nsub // GROUP
    record = (sub_code.reshape(rows, nblk, GROUP).to(torch.int64) << shifts).sum(-1) | scale_bits.to(torch.int64)
    return torch.cat(
        [nib.reshape(rows, 16 * nsub).to(torch.uint8), high.reshape(rows, 8 * nsub).to(torch.uint8),
         record.view(torch.uint8).reshape(rows, 8 * nblk)], dim=1)


def unpack(payload: torch.Tensor, cols: int) -> tuple:
    """Inverse of ``pack``: (codes [rows, nsub, 32], sub codes [rows, nsub], scale bits)."""
    rows = payload.shape[0]
    nsub = cols // SUB
    off_nib, off_high, off_rec = plane_offsets(cols)
    p = payload.to(torch.int32)
    nib = p[:, off_nib:off_high].reshape(rows, nsub, 16)
    high = p[:, off_high:off_rec].reshape(rows, nsub, 8)
    low = torch.stack([nib & 15, nib >> 4], dim=-1).reshape(rows, nsub, SUB)
    top = torch.stack([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(rows, nsub, SUB)
    record = payload[:, off_rec:].contiguous().view(torch.int64)  # [rows, nblk]
    shifts = 16 + 6 * torch.arange(GROUP, device=payload.device)
    sub_code = ((record[..., None] >> shifts) & 63).reshape(rows, nsub)
    return low | (top << 4), sub_code.to(torch.int32), record & 0xFFFF


def dequantize(payload: torch.Tensor, cols: int, factor: float = 1.0) -> torch.Tensor:
    """Payload -> fp32 values in the rotated domain times ``factor`` (a power of two,
    applied to the level so that the product with the sub-scale rounds once),
    [rows, cols // 32, 32]."""
    code, sub_code, scale_bits = unpack(payload, cols)
    scale = (scale_bits.to(torch.int32) << 16).view(torch.float32)
    sub_scale = scale.repeat_interleave(GROUP, dim=1) * sub_ratio(sub_code)
    v = level(code & 31) * factor * sub_scale[..., None]
    return torch.where(code >= 32, -v, v)


def poison_overflow(x: torch.Tensor) -> torch.Tensor:
    """Every block of x [rows, cols] holding +-Inf (a sum beyond the output dtype's range)
    becomes all NaN, in place; returns x."""
    rows, cols = x.shape
    blocks = x.view(rows, cols // BLOCK, BLOCK)
    blocks.masked_fill_(blocks.isinf().any(-1, keepdim=True), float("nan"))
    return x


def decode_accumulate(payloads: list, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Sum of the payloads' values: fp32 sum in list order of the rotated values times
    HEADROOM, one inverse rotation (H / HEADROOM, exact in float64), one rounding to
    ``dtype``; a block that overflows ``dtype`` is NaN."""
    rows, cols = shape
    _check_cols(cols)
    acc = dequantize(payloads[0], cols, HEADROOM)
    for p in payloads[1:]:
        acc = acc + dequantize(p, cols, HEADROOM)
    x = (rotate(acc) / HEADROOM).reshape(rows, cols).to(dtype)
    return poison_overflow(x)


def decode(payload: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return decode_accumulate([payload], shape, dtype)
