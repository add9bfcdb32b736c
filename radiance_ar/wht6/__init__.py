"""wht6: a 6.25-bit Walsh-Hadamard codec for compressed all-reduce.

Public API: ``encode``, ``decode``, ``decode_accumulate``, ``reduce_encode``, ``bits_per_value``,
``payload_shape``, ``cols_reason``, and the format constants and sizes, defined once in
``reference.py`` (every other module imports them from here): ``BLOCK``, ``SUB``,
``GROUP``, ``BLOCK_BYTES``, ``SCALE_MIN``, ``padded_cols``, ``payload_bytes_per_row``.
CUDA/ROCm tensors run Triton kernels (imported lazily), every other device runs the
plain-torch reference (``reference.py``, the spec in code).

Wire format
-----------
A tensor [rows, cols] (bf16, fp16 or fp32; cols a multiple of BLOCK = 256) becomes a
uint8 payload [rows, 25 * cols / 32]: payload row r depends on input row r only, so
row slices of a tensor and of its payload correspond. Every 32 consecutive values of a
row form a sub-block; 8 consecutive sub-blocks (256 values) form a block.

1. Rotate each sub-block: y = H32 @ x / 32 (Sylvester-Hadamard, entries +-1; H32 @ H32
   = 32 I, so the decoder's inverse is x = H32 @ y). The power-of-two normalization
   keeps |y| <= max |x| (no finite input overflows) and max |y| >= max |x| / 32.
2. Block scale S: the max |y| over the block, rounded UP to bf16 (so nothing clips).
   An all-zero block has S = 0 and decodes to exact zeros.
3. Sub-block scale s_g = fp32(S * r(c_g)), r(c) = v * v with v = fp32(c * fp32(1/63))
   (quadratic: reaches 1/3969 of S, for sub-blocks next to massive activations), c_g
   in 0..63 the smallest code with s_g >= max |y| over sub-block g (0: all zero).
4. Each value: u = min(|y| * fp32(1 / s_g), 1); magnitude q = floor((sqrt(u + 9/16)
   - 3/4) * 63) clamped to 0..31; code = 32 * (y < 0) + q. Decode: level
   L(q) = t (3 + t) / 4 with t = fp32(2q + 1) * fp32(1/63), value = +-L(q) * s_g.
   The levels are the midpoints t_q of 32 uniform bins of t in [0, 1] pushed through
   the compander u = t(3+t)/4: 1.67x denser near zero than at the top; L(31) = 1.
   Rounding is the floor of the inverse compander, i.e. round-to-nearest in t with
   ties going up (floor(t * 31.5)). Every step is an IEEE fp32 operation (+, *, /,
   sqrt, rounded to nearest even) in a fixed order, so the codes are a pure function
   of the input, the same on every rank. Only the rotation's fp32 sums are
   accumulated in a kernel-specific order (the reference sums exactly and rounds
   once), so a GPU payload may differ from the CPU reference's by one step where a
   last-bit difference crosses a decision edge; ranks running one kernel agree.
5. Row layout (bytes), for nsub = cols / 32 sub-blocks and nblk = cols / 256 blocks:
   [0, cols/2)          low nibble plane: sub-block j at 16 j; byte k holds bits 0-3
                        of code 2k (low nibble) and of code 2k+1 (high nibble);
   [cols/2, 3 cols/4)   high plane: sub-block j at cols/2 + 8 j; byte k holds bits 4-5
                        of codes 4k..4k+3 at bit positions 0, 2, 4, 6;
   [3 cols/4, 25 cols/32)  block records, one little-endian int64 per block b at
                        3 cols/4 + 8 b: bits 0-15 the bf16 bits of S, bits 16+6g..21+6g
                        the sub-scale code c_g of the block's sub-block g.
   The planes start at multiples of 64 bytes and the row stride is a multiple of 8,
   so kernels load the planes as int32 words and the records as int64.
   Per block: 256 x 6 bits + 64 bits = 200 bytes: exactly 6.25 bits/value including
   scales (cols = 5120: 4000 bytes per row). QuickReduce INT6 is 6.5.
6. Range. A block is coded when it is all zeros or when SCALE_MIN = 2**-114 <= max |y|
   <= the bf16 max (3.39e38); by 1. that holds for every finite block with 2**-109
   (1.5e-33) <= max |x| <= 3.38e38. SCALE_MIN keeps every sub-scale (>= S / 3969) a
   normal fp32 number. Any other block is sent with S = NaN (bf16 0x7FC0) and zero
   codes, and ALL 256 of its values decode to NaN: one holding NaN or +-Inf, one whose
   max |y| exceeds the bf16 max (fp32 input beyond ~3.39e38), a non-zero one whose max
   |y| is below SCALE_MIN (certain for max |x| < 2**-114 = 4.8e-35, subnormal input
   included). Other blocks are unaffected. Within the coded range a power-of-two
   factor on x scales S exactly and leaves the codes as they are (up to the rounding
   of rotated values below 2**-126). Never 0 for a non-zero block, never a plausible
   finite number for one out of range.

decode_accumulate(payloads) dequantizes each payload into the rotated domain times
HEADROOM = 1/8 (y_w / 8 = fp32(L(q) / 8 * s_g): exact but where it is below 2**-126,
then rounded as a subnormal), sums them in fp32 in list order (8 payloads of any
scale cannot overflow), applies ONE inverse rotation x = H32 @ acc * 8 and rounds ONCE
to the output dtype: given the same payload order every rank gets the same bits. A
block of the result holding a value beyond the output dtype's range (3.4e38 for
fp32/bf16, 65504 for fp16) decodes to NaN entirely, never +-Inf; a NaN block of any
payload makes that block of the sum NaN.

Error (``python tools/bench_codec.py``: 1024x5120 bf16 per rank, W = 2, 4, 8 summed by
decode_accumulate vs a float64 sum), as a ratio to the relative RMS error of the
QuickReduce INT6 baseline (``baseline_int6.py``): 0.98 Gaussian, 0.58 Student-t(3), 0.33
outlier channels, 0.98-0.99 outlier tokens. Known limit (found in a review, 2026-12-05):
the lowest magnitude level decodes to L(0) s_g ~ 0.012 s_g, not 0, so where few rotated
values hold a sub-block's energy (constant sub-blocks) the other 31 codes carry equal
errors that add up on one element. On the CPU reference (``decode(encode(x), shape,
torch.float32)`` on 64 x 256 bf16 rows, each sub-block of 32 one random constant):
relative RMS error 0.068 (INT6, ``baseline_int6.round_trip``: 0; Gaussian rows: 0.021);
``ones(1, 256)`` decodes to 1.371 at [0, 0]; in fp16 a constant 47000 decodes to 64576
and 46528, and 48000 to NaN, inside the range 6. states. A level 0 that decodes to 0
would remove it; the format is left as it is until its kernels can run on a GPU. The alternative formats this one was
measured against, with their errors, and the Student-t target it does not meet are in
docs/history.md ('The wht6 codec: what was tried').
"""
import torch

from . import reference
from .reference import BLOCK, BLOCK_BYTES, GROUP, SCALE_MIN, SUB, padded_cols, payload_bytes_per_row

__all__ = ["BLOCK", "BLOCK_BYTES", "GROUP", "MAX_PAYLOADS", "SCALE_MIN", "SUB", "payload_bytes",
           "SUM_REL_RMS_BOUND", "bits_per_value", "cols_reason", "decode", "decode_accumulate",
           "encode", "padded_cols", "payload_bytes_per_row", "payload_shape", "reduce_encode"]

#: bound on the relative RMS error of a decode_accumulate of W encoded bf16 tensors vs
#: their exact sum, on Gaussian-like data: one payload's error is ~0.021 relative
#: (tools/bench_codec.py: 0.021 on Gaussian, 0.98x INT6), errors add like the partials do, and the
#: bf16 rounding of the sum adds 2^-9; 2^-5 leaves 1.5x of margin.
SUM_REL_RMS_BOUND = 2.0 ** -5
# Payloads one decode_accumulate kernel launch sums: also the sum's fp32 headroom
# (1 / reference.HEADROOM). The reference takes any number; past 8, a partial sum of
# blocks near the bf16 max can overflow, and that block of the result is NaN.
MAX_PAYLOADS = 8
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def bits_per_value(cols: int) -> float:
    """Bits on the wire per input value, scales included (6.25 for every valid cols)."""
    _check_cols("cols", cols)
    return 8.0 * reference.payload_bytes_per_row(cols) / cols


def payload_bytes(numel: int) -> int:
    """Payload bytes of ``numel`` values (whole blocks: rows of a multiple of BLOCK)."""
    return -(-numel // BLOCK) * BLOCK_BYTES


def payload_shape(rows: int, cols: int) -> tuple:
    """Shape of the uint8 payload of a [rows, cols] tensor."""
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be a non-negative int, got {rows!r}")
    _check_cols("cols", cols)
    return rows, reference.payload_bytes_per_row(cols)


def cols_reason(cols) -> str | None:
    """Pure gate: ``None`` if rows of ``cols`` values can be coded, else why not."""
    if not isinstance(cols, int) or isinstance(cols, bool) or cols <= 0 or cols % BLOCK:
        return f"must be a positive multiple of {BLOCK} (the wht6 block), got {cols!r}"
    return None


def _check_cols(name: str, cols) -> None:
    reason = cols_reason(cols)
    if reason is not None:
        raise ValueError(f"{name} {reason}")


def _check_values(name: str, t, shape=None, dtype=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} dtype must be one of bfloat16, float16, float32, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} dtype must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    _check_cols(f"{name}.shape[1]", t.shape[1])
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along columns, got strides {t.stride()}")


def _check_payload(name: str, p, rows: int, cols: int, device=None) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.dtype != torch.uint8:
        raise TypeError(f"{name} must have dtype torch.uint8, got {p.dtype}")
    expected = payload_shape(rows, cols)
    if tuple(p.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} for a [{rows}, {cols}] tensor, got {tuple(p.shape)}")
    if not p.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row slices of a contiguous payload are)")
    if device is not None and p.device != device:
        raise ValueError(f"{name} is on {p.device}, expected {device}")


def _check_shape(shape) -> tuple:
    if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2
            and all(isinstance(n, int) for n in shape)):
        raise ValueError(f"shape must be (rows, cols) ints, got {shape!r}")
    rows, cols = shape
    if rows < 0:
        raise ValueError(f"shape rows must be >= 0, got {rows}")
    _check_cols("shape cols", cols)
    return rows, cols


def _check_dtype(dtype) -> None:
    if dtype not in _DTYPES:
        raise TypeError(f"dtype must be one of torch.bfloat16, torch.float16, torch.float32, got {dtype!r}")


def encode(x: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """Encode a 2-D float tensor into its uint8 payload (into ``out`` if given)."""
    _check_values("x", x)
    rows, cols = x.shape
    if out is not None:
        _check_payload("out", out, rows, cols, x.device)
    if x.is_cuda:
        from radiance_ar.wht6.wht6_encode import wht6_encode
        return wht6_encode(x, out)
    payload = reference.encode(x)
    if out is None:
        return payload
    return out.copy_(payload)


def decode(payload: torch.Tensor, shape, dtype: torch.dtype, out: torch.Tensor = None) -> torch.Tensor:
    """Decode one payload into a [rows, cols] tensor of ``dtype`` (into ``out`` if given)."""
    rows, cols = _check_shape(shape)
    _check_dtype(dtype)
    _check_payload("payload", payload, rows, cols)
    if out is not None:
        _check_values("out", out, (rows, cols), dtype)
        if out.device != payload.device:
            raise ValueError(f"out is on {out.device}, expected {payload.device}")
    if payload.is_cuda:
        from radiance_ar.wht6.wht6_decode_accumulate import wht6_decode_accumulate
        return wht6_decode_accumulate([payload], (rows, cols), dtype, out)
    result = reference.decode(payload, (rows, cols), dtype)
    return result if out is None else out.copy_(result)


def _check_payloads(payloads, shape, dtype) -> tuple:
    """(rows, cols, device) of a call on a list of payloads of [rows, cols] tensors."""
    rows, cols = _check_shape(shape)
    _check_dtype(dtype)
    if not isinstance(payloads, (list, tuple)) or not payloads:
        raise ValueError("payloads must be a non-empty list of uint8 payload tensors")
    device = payloads[0].device if isinstance(payloads[0], torch.Tensor) else None
    for i, p in enumerate(payloads):
        _check_payload(f"payloads[{i}]", p, rows, cols, device)
    if device.type == "cuda" and len(payloads) > MAX_PAYLOADS:
        raise ValueError(f"at most {MAX_PAYLOADS} payloads per call on the GPU, got {len(payloads)}")
    return rows, cols, device


def decode_accumulate(payloads: list, shape, dtype: torch.dtype, out: torch.Tensor = None) -> torch.Tensor:
    """Sum of the tensors encoded in ``payloads`` (fp32 sum in list order in the rotated
    domain, one inverse rotation, rounded once to ``dtype``), into ``out`` if given."""
    rows, cols, device = _check_payloads(payloads, shape, dtype)
    if out is not None:
        _check_values("out", out, (rows, cols), dtype)
        if out.device != device:
            raise ValueError(f"out is on {out.device}, expected {device}")
    if device.type == "cuda":
        from radiance_ar.wht6.wht6_decode_accumulate import wht6_decode_accumulate
        return wht6_decode_accumulate(list(payloads), (rows, cols), dtype, out)
    result = reference.decode_accumulate(list(payloads), (rows, cols), dtype)
    return result if out is None else out.copy_(result)


def reduce_encode(payloads: list, shape, dtype: torch.dtype, out: torch.Tensor = None) -> torch.Tensor:
    """``encode(decode_accumulate(payloads, shape, dtype))``, the payload of the sum
    rounded to ``dtype`` (into ``out`` if given): on the GPU one kernel that never
    writes the sum (``wht6_reduce_encode``), the same bytes as the two."""
    rows, cols, device = _check_payloads(payloads, shape, dtype)
    if out is not None:
        _check_payload("out", out, rows, cols, device)
    if device.type == "cuda":
        from radiance_ar.wht6.wht6_reduce_encode import wht6_reduce_encode
        return wht6_reduce_encode(list(payloads), (rows, cols), dtype, out)
    return encode(reference.decode_accumulate(list(payloads), (rows, cols), dtype), out)
