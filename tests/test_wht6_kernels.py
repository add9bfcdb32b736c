"""The wht6 codec's Triton kernels against its torch reference: under the Triton
interpreter on CPU, and on a GPU (marked ``gpu``)."""

import os
import subprocess
import sys

import pytest
import torch

from radiance_ar import wht6
from radiance_ar.wht6 import reference as ref
from wht6_cases import ROOT, assert_within_format_bound, check_fp16_overflow, check_range, make


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
    """Within one output ulp, plus what the kernel's fp32 sums in another order may move
    before the one rounding: 2**-18 of the largest output of the sub-block (a review
    measured 2**-22.8 under Triton's interpreter; 2**-12, the allowance before, let a
    2**-13 error through). NaN exactly where the reference has NaN, which also proves the
    (NaN-poisoned) output was fully written."""
    k, e = kernel.cpu().double(), expected.double()
    assert torch.equal(k.isnan(), e.isnan()), "NaN pattern differs (output not fully written?)"
    rows, cols = e.shape
    finite = e.isfinite()
    sub_max = e.where(finite, 0).abs().reshape(rows, -1, 32).amax(-1, keepdim=True)
    tol = _ulp(e, dtype) + 2.0**-18 * sub_max.expand(rows, -1, 32).reshape(rows, cols)
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
            if device != "cpu" and dtype != torch.float32:
                # rounded ONCE, to nearest: the fp32 sum's own rounding to the dtype, bit for
                # bit (a truncating store would pass the ulp allowance above; Triton's
                # interpreter truncates, so this is for GPUs only)
                wide = torch.empty((rows, cols), dtype=torch.float32, device=device)
                wht6_decode_accumulate(dev_payloads, (rows, cols), torch.float32, wide)
                assert torch.equal(out.view(torch.int16), wide.to(dtype).view(torch.int16))


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
    # fp32 output: an error of 2**-13 of the sub-block's largest value is refused
    wide = ref.decode(good, (4, 512), torch.float32)
    nudged = wide.clone()
    nudged[0, 5] += 2.0 ** -13 * float(wide[0, :32].abs().max())
    with pytest.raises(AssertionError):
        assert_decoded_agree(nudged, wide, torch.float32)


INTERPRETER_CASES = [(3, 512, torch.bfloat16, 0), (17, 768, torch.float16, 256), (2, 256, torch.float32, 0)]


def _under_interpreter(call: str) -> None:
    """Run ``t.<call>`` (t = this module) with the Triton kernels on CPU tensors under
    TRITON_INTERPRET=1 (set before triton is imported, hence a subprocess)."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    code = f"import sys, torch; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import test_wht6_kernels as t; t.{call}"
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


def check_reduce_encode(device: str, cases: list, seed: int = 7) -> None:
    """The fused reduce-encode kernel, for (rows, cols, dtype, _) cases and 1, 3 and 8
    payloads (a NaN block in one): the bytes the decode-accumulate and encode kernels give
    one after the other on ``device`` (the same tile math, so identical), into a payload
    poisoned with 0x00 and with 0xFF (every byte written), and the reference's encode of
    that sum (the decode kernel is held to the reference above) within its one-step moves.
    Not for one payload: its decode lies on the codec's own levels and sub-scales, where a
    last-bit difference of the rotation moves a sub-scale a step and with it every code of
    the sub-block (fp32, 2 x 256: 21 of 512 codes), beyond that bound's 1e-3."""
    from radiance_ar.wht6.wht6_decode_accumulate import wht6_decode_accumulate
    from radiance_ar.wht6.wht6_encode import wht6_encode
    from radiance_ar.wht6.wht6_reduce_encode import wht6_reduce_encode

    kinds = ["gaussian", "student_t3", "outlier_channels", "outlier_tokens"]
    for i, (rows, cols, dtype, _) in enumerate(cases):
        xs = [make(kinds[(i + w) % 4], rows, cols, seed + 10 * i + w).to(dtype) for w in range(8)]
        xs[1][rows - 1, cols // 2] = float("nan")
        pays = [ref.encode(x) for x in xs]
        for n in (1, 3, 8):
            dev = [p.to(device) for p in pays[:n]]
            total = wht6_decode_accumulate(dev, (rows, cols), dtype)
            two = wht6_encode(total).cpu()
            for poison in (0x00, 0xFF):
                got = torch.full(wht6.payload_shape(rows, cols), poison, dtype=torch.uint8,
                                 device=device)
                wht6_reduce_encode(dev, (rows, cols), dtype, got)
                assert torch.equal(got.cpu(), two), (rows, cols, dtype, n, poison)
            if n > 1:  # one payload decoded sits on the codec's grid: see the doc
                assert_payloads_agree(two, ref.encode(total.cpu()), total.float().cpu())


def test_interpreter_reduce_encode_is_decode_then_encode():
    _under_interpreter("check_reduce_encode('cpu', t.INTERPRETER_CASES)")


def test_reduce_encode_on_cpu_is_the_reference_composition():
    pays = [ref.encode(make("gaussian", 3, 512, seed=w).to(torch.bfloat16)) for w in range(3)]
    out = torch.full(wht6.payload_shape(3, 512), 0xFF, dtype=torch.uint8)
    wht6.reduce_encode(pays, (3, 512), torch.bfloat16, out=out)
    assert torch.equal(out, ref.encode(ref.decode_accumulate(pays, (3, 512), torch.bfloat16)))
    with pytest.raises(ValueError, match="payloads\\[1\\] must have shape"):
        wht6.reduce_encode([pays[0], pays[1][:2]], (3, 512), torch.bfloat16)
    with pytest.raises(ValueError, match="out must have shape"):
        wht6.reduce_encode(pays, (3, 512), torch.bfloat16, out=out[:2])


@pytest.mark.gpu
def test_gpu_reduce_encode_is_decode_then_encode():
    check_reduce_encode("cuda", [(1, 256, torch.bfloat16, 0), (37, 5120, torch.bfloat16, 0),
                                 (300, 1536, torch.float16, 0), (5, 768, torch.float32, 0)])


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
