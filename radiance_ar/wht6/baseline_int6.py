"""QuickReduce-style INT6 codec, for comparison with wht6 only (never on the wire here).

Implemented from the published format (vllm csrc/quickreduce/quick_reduce_impl.cuh),
not from its code:
- blocks of 32 consecutive values of a row, no rotation;
- scale = (signed value of largest magnitude in the block) * (-1/32), stored as fp16,
  so the extreme maps to code -32;
- q = clamp(round_half_even(x / scale), -32, 31), sent as q + 32 in 6 bits;
- 6-bit codes + one fp16 scale per 32 values: 1664 bytes per 2048 values = 6.5 bits/value.
Arithmetic is fp32 with the fp16-rounded scale. An all-zero block has scale 0 and
decodes to zeros. A non-finite value makes the block's scale non-finite (what the fp16
arithmetic gives; not a documented behaviour of QuickReduce).
QuickReduce's two-shot schedule also re-quantizes the partial sums and accumulates in
bf16; ``decode_sum`` models only the codec (fp32 sum, one rounding), which flatters it.
"""
import torch

BLOCK = 32


def bits_per_value() -> float:
    """Bits on the wire per value, scales included: (32 * 6 + 16) / 32."""
    return (BLOCK * 6 + 16) / BLOCK


def quantize(x: torch.Tensor) -> tuple:
    """[rows, cols] -> (codes int8 in -32..31 [rows, cols], scales fp16 [rows, cols / 32])."""
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"cols must be a multiple of {BLOCK}, got {cols}")
    b = x.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    extreme = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    scale = (extreme * (-1.0 / 32.0)).to(torch.float16)
    s = scale.to(torch.float32)
    q = torch.where(s != 0, torch.round(b / s), 0.0).clamp(-32, 31)
    return q.to(torch.int8).reshape(rows, cols), scale.squeeze(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(codes, scales) -> fp32 [rows, cols]."""
    rows, cols = codes.shape
    b = codes.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK) * scales.to(torch.float32)[..., None]
    return b.reshape(rows, cols)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize(x))


def decode_sum(encoded: list, dtype: torch.dtype) -> torch.Tensor:
    """Sum of several (codes, scales) in fp32 in list order, rounded once to ``dtype``."""
    acc = dequantize(*encoded[0])
    for codes, scales in encoded[1:]:
        acc = acc + dequantize(codes, scales)
    return acc.to(dtype)
