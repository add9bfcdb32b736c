"""Fused one-shot all-reduce with the wht6 codec: encode, publish, wait, decode-sum.

One launch per call on every rank r of W, grid = the CTA budget G (each CTA loops over
its tiles, tile i belongs to CTA i mod G on every rank)::

    t      = flag_r[c] + 1                      # this call's epoch, kept on the device
    region = (t mod 2) * region_bytes           # double-buffered payload region
    for tile in my tiles:  pub_r[region + tile] = encode(x[tile])   (and own[tile])
    bar.sync; flag_r[c] = t                     # st.release.sys: the payload first
    for p != r: spin until flag_p[c] >= t       # ld.acquire.sys, bounded (below)
    bar.sync
    for tile in my tiles:
        acc = dequant(P_0[tile]) / 8; acc += dequant(P_p[tile]) / 8 for p = 1..W-1  # fp32
        out[tile] = round(H32 @ acc * 8)        # ONE inverse rotation, ONE rounding

Math and wire format are the wht6 codec's (``backends/wht6/__init__.py``): a payload
row is ``25 cols / 32`` bytes (6.25 bits/value); P_r is this rank's own payload read
back (from ``own`` or its published region), never its unquantized input, so every rank
sums the same W payloads in the same order 0..W-1 and gets the same bits. A tile is T
sub-blocks of 32 values in row-major order (``backends.kernels.wht6_tile``). Rows whose
``cols`` is not a multiple of 256 are zero-padded to the next multiple: the payload is
that of the padded row and the padding is never stored to ``out`` (the backend passes
multiples of 256 only; the kernel is tested with both).

Epochs. The CTA's own flag word is its epoch counter: it lives with the flags (device
or pinned host memory), the kernel bumps it, and no host integer is baked into a
launch, so CUDA-graph replays keep counting. Every CTA runs every call (tiles or not),
so all G counters, and every rank's, stay equal. Why two regions suffice: rank r
writes region (t mod 2) again at call t+2, after its call t+1 saw every peer's flag at
t+1, i.e. after every peer's stream had finished call t, its reads of that region too.

Bounded spin. A CTA that waits longer than ``timeout`` for a peer writes the error words
``err[0] = t``, ``err[1] = peer + 1``, ``err[2] = 1`` and carries on (the call's output
is garbage), so the kernel always ends; the host turns the words into an exception.

Call contract. Beside each epoch flag a CTA writes the call's signature hash (rows,
cols, dtype and the op's M and K: :mod:`backends.call_contract`) in the slot of the
call's parity. A waiter that sees its peer's flag reach ``t`` reads the slot of parity
``t``: another signature, or a flag beyond ``t + 1`` (the peer is in another call),
writes ``err[2] = 2`` (a mismatch) and the host raises ``CollectiveMismatchError``. The bound is
``%globaltimer`` nanoseconds since the CTA began waiting, on NVIDIA; elsewhere a count
of flag reads per peer (``ITERS_PER_MS`` per millisecond: a read of peer or host memory
takes about 1 us; a faster read shortens the bound, never lengthens it).

Ordering per platform (``sync`` mode): NVIDIA: PTX ``ld.acquire.sys`` / ``st.release.sys``
by every thread (plain loads and stores: no read-modify-write on host memory, which PCIe
does not make atomic); ROCm: Triton atomics (a CAS that never matches, an exchange);
the Triton interpreter (programs run one after another): plain volatile loads and stores.

Triton is imported at the first launch (this module imports without Triton). Launches
use ``enable_fp_fusion=False``, as the codec's kernels do.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from backends import envs
from backends.wht6 import BLOCK, BLOCK_BYTES, SUB



SUBS_PER_PROGRAM = 64  # T: sub-blocks per tile (2048 values), as in the codec's kernels
MAX_RANKS = 8  # payload and flag pointer arguments
ITERS_PER_MS = 1000  # spin bound without a timer (see module doc)
#: flag value of a passive peer (timing mode): above any epoch a run reaches; its
#: signature is not checked
PASSIVE_EPOCH = 2 ** 62
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# bf16 pieces that carry the input exactly / the sum well below one output rounding
# (the codec's encode and decode_accumulate kernels use the same).
_SPLITS_IN = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_SPLITS_OUT = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 3}

tl: Any = None  # triton.language, bound by _kernel() at the first launch
wht6_tile: Any = None  # backends.kernels.wht6_tile, bound likewise
_jitted: Any = None


def _nth(i: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
    # Pointer argument number i (i is a compile-time constant).
    v = a0
    if i == 1:
        v = a1
    if i == 2:
        v = a2
    if i == 3:
        v = a3
    if i == 4:
        v = a4
    if i == 5:
        v = a5
    if i == 6:
        v = a6
    if i == 7:
        v = a7
    return v


def _load_flag(ptr, SYNC: tl.constexpr):
    if SYNC == 1:
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr],
                                      dtype=tl.int64, is_pure=False, pack=1)
    elif SYNC == 2:
        never = tl.full([], -1, tl.int64)  # flags are >= 0: the CAS never writes
        v = tl.atomic_cas(ptr, never, never, sem="acquire", scope="sys")
    else:
        v = tl.load(ptr, volatile=True)
    return v


def _store_flag(ptr, value, SYNC: tl.constexpr):
    if SYNC == 1:
        tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,l", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
    elif SYNC == 2:
        tl.atomic_xchg(ptr, value.to(tl.int64), sem="release", scope="sys")
    else:
        tl.store(ptr, value)


def _clock(TIMER: tl.constexpr):
    if TIMER:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
    else:
        now = tl.full([], 0, tl.int64)
    return now


def _value_ptrs(base, f0, n_sub, subs_per_row, cols, row_stride, T: tl.constexpr):
    # Like wht6_tile.subblock_ptrs, with the padding columns (>= cols) masked off.
    f = f0 + tl.arange(0, T).to(tl.int64)
    col = (f % subs_per_row)[:, None] * 32 + tl.arange(0, 32)[None, :]
    offs = (f // subs_per_row)[:, None] * row_stride + col
    return base + offs, (f < n_sub)[:, None] & (col < cols)


def _oneshot_wht6_kernel(
    x_ptr,              # this rank's slice [rows, cols], unit column stride
    out_ptr,            # the reduced slice [rows, cols], same dtype
    pub0, pub1, pub2, pub3, pub4, pub5, pub6, pub7,  # *u8 every rank's payload buffer
                        # (two regions of region_bytes), rank order; unused repeat pub0
    flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7,  # *i64 every rank's 3 G words:
                        # G epoch flags, then 2 G call signatures (parity t mod 2);
                        # rank order; unused repeat flag0
    own_ptr,            # *u8 private copy of this rank's payload (read if OWN_COPY)
    err_ptr,            # *i64 [3] error words: epoch, peer + 1, kind (1 timeout, 2 mismatch)
    rank,               # this rank, 0..W-1
    n_sub,              # rows * cols_padded / 32 sub-blocks; 0 = warm-up, touches nothing
    subs_per_row,       # cols_padded / 32
    cols,               # real columns (the rest of a padded row is zeros)
    x_row_stride,       # elements between rows of x
    out_row_stride,     # elements between rows of out
    pay_row_w64,        # payload row stride in int64 words (25 cols_padded / 256)
    region_bytes,       # bytes of one payload region (a multiple of 8)
    timeout,            # spin bound: nanoseconds (TIMER) or flag reads
    sig,                # this call's signature hash (> 0): every rank's must be equal
    W: tl.constexpr,         # ranks, 1..8
    T: tl.constexpr,         # sub-blocks per tile, a multiple of 8
    SPLITS_IN: tl.constexpr,   # bf16 pieces for the forward rotation
    SPLITS_OUT: tl.constexpr,  # bf16 pieces for the inverse rotation
    DOT_FP32: tl.constexpr,    # rotation products in fp32 (interpreter)
    OWN_COPY: tl.constexpr,    # also write own_ptr, and read this rank's payload there
    SYNC: tl.constexpr,        # 0 plain (interpreter), 1 PTX acquire/release, 2 atomics
    TIMER: tl.constexpr,       # bound by %globaltimer (else by iterations)
):
    if n_sub > 0:
        pid = tl.program_id(0)
        ctas = tl.num_programs(0)
        my_pub = _nth(0, pub0, pub1, pub2, pub3, pub4, pub5, pub6, pub7)
        my_flag = flag0 + pid
        for q in tl.static_range(1, W):
            if q == rank:
                my_pub = _nth(q, pub0, pub1, pub2, pub3, pub4, pub5, pub6, pub7)
                my_flag = _nth(q, flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7) + pid
        t = _load_flag(my_flag, SYNC) + 1
        region = (t % 2) * region_bytes
        n_tiles = tl.cdiv(n_sub, T)
        for tile in range(pid, n_tiles, ctas):
            f0 = tile * T  # int32: launch checks n_sub < 2**31; helpers widen
            ptrs, mask = _value_ptrs(x_ptr, f0, n_sub, subs_per_row, cols, x_row_stride, T)
            nib, high, rec = wht6_tile.encode_tile(
                tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), T, SPLITS_IN, DOT_FP32)
            nib_p, high_p, rec_p, sub_m, blk_m = wht6_tile.payload_ptrs(
                my_pub + region, f0, n_sub, subs_per_row, pay_row_w64, T)
            tl.store(nib_p, nib, mask=sub_m[:, None])
            tl.store(high_p, high, mask=sub_m[:, None])
            tl.store(rec_p, rec, mask=blk_m)
            if OWN_COPY:
                nib_p, high_p, rec_p, sub_m, blk_m = wht6_tile.payload_ptrs(
                    own_ptr, f0, n_sub, subs_per_row, pay_row_w64, T)
                tl.store(nib_p, nib, mask=sub_m[:, None])
                tl.store(high_p, high, mask=sub_m[:, None])
                tl.store(rec_p, rec, mask=blk_m)
        # The call's signature beside the flag, in the slot of its parity (a peer one
        # call ahead writes the other slot), before the release that publishes both.
        tl.store(my_flag + ctas * (1 + t % 2), sig)
        # Every thread's payload stores happen before any thread's release of the flag.
        tl.debug_barrier()
        _store_flag(my_flag, t, SYNC)
        if pid < n_tiles:
            start = _clock(TIMER)
            for p in tl.static_range(W):
                if p != rank:
                    peer_flag = _nth(p, flag0, flag1, flag2, flag3, flag4, flag5, flag6,
                                     flag7) + pid
                    seen = _load_flag(peer_flag, SYNC)
                    spent = _clock(TIMER) - start
                    while (seen < t) & (spent < timeout):
                        seen = _load_flag(peer_flag, SYNC)
                        if TIMER:
                            spent = _clock(TIMER) - start
                        else:
                            spent += 1
                    if seen < t:
                        tl.store(err_ptr, t)
                        tl.store(err_ptr + 1, p + 1)
                        tl.store(err_ptr + 2, 1)
                    else:
                        # A live peer is at call t or t + 1 and its slot of parity t
                        # holds call t's signature; anything else is another call.
                        their = _load_flag(peer_flag + ctas * (1 + t % 2), SYNC)
                        live = seen < 0x4000000000000000  # PASSIVE_EPOCH
                        if live & ((seen > t + 1) | (their != sig)):
                            tl.store(err_ptr, t)
                            tl.store(err_ptr + 1, p + 1)
                            tl.store(err_ptr + 2, 2)
            tl.debug_barrier()
            own_src = my_pub + region
            if OWN_COPY:
                own_src = own_ptr
            for tile in range(pid, n_tiles, ctas):
                f0 = tile * T  # int32: launch checks n_sub < 2**31; helpers widen
                src = pub0 + region
                if rank == 0:
                    src = own_src
                acc = wht6_tile.load_dequantize(src, f0, n_sub, subs_per_row, pay_row_w64, T)
                for p in tl.static_range(1, W):
                    src = _nth(p, pub0, pub1, pub2, pub3, pub4, pub5, pub6, pub7) + region
                    if p == rank:
                        src = own_src
                    acc += wht6_tile.load_dequantize(src, f0, n_sub, subs_per_row,
                                                     pay_row_w64, T)
                res = wht6_tile.decode_tile(acc, out_ptr.dtype.element_ty, T, SPLITS_OUT,
                                            DOT_FP32)
                ptrs, mask = _value_ptrs(out_ptr, f0, n_sub, subs_per_row, cols,
                                         out_row_stride, T)
                tl.store(ptrs, res, mask=mask)


def _kernel() -> Any:
    global tl, wht6_tile, _jitted, _nth, _load_flag, _store_flag, _clock, _value_ptrs
    if _jitted is None:
        try:
            import triton
            import triton.language as language
        except ImportError as e:
            raise RuntimeError(f"oneshot_wht6 on a GPU needs Triton: pip install triton "
                               f"({e})") from None
        from backends.kernels import wht6_tile as tiles

        tl, wht6_tile = language, tiles
        _nth, _load_flag, _store_flag, _clock, _value_ptrs = (
            triton.jit(f) for f in (_nth, _load_flag, _store_flag, _clock, _value_ptrs))
        # Values that change from call to call must not select a new specialization
        # (a compile mid-run would keep every peer spinning): see ``launch``.
        _jitted = triton.jit(_oneshot_wht6_kernel,
                             do_not_specialize=["rank", "n_sub", "region_bytes", "timeout", "sig"])
    return _jitted




def padded_cols(cols: int) -> int:
    return -(-cols // BLOCK) * BLOCK


def payload_bytes_per_row(cols: int) -> int:
    """Bytes of one payload row for ``cols`` values (padded to a multiple of 256)."""
    return padded_cols(cols) // BLOCK * BLOCK_BYTES


def modes(device: torch.device) -> tuple[int, bool]:
    """(SYNC, TIMER) for kernels on ``device`` (see the module doc)."""
    if envs.triton_interpreter() or device.type == "cpu":
        return 0, False
    if torch.version.hip is not None:
        return 2, False
    return 1, True


def launch(x: torch.Tensor, out: torch.Tensor, pubs: Sequence[Any], flags: Sequence[Any],
           own: Any, err: Any, rank: int, region_bytes: int, timeout_ms: float, ctas: int,
           sig: int = 1, warm_up: bool = False) -> None:
    """Enqueue one call on the current stream (see the module doc).

    ``pubs`` / ``flags``: every rank's payload buffer (uint8, two regions of
    ``region_bytes``) and flag words (int64, at least ``ctas``), in rank order, as
    tensors or :func:`backends.kernels.pointers.kernel_pointer` s. ``own``: this rank's private payload copy (or
    None: its payload is read back from ``pubs[rank]``). ``err``: int64 [2] error words.
    ``sig``: the call's signature hash (1 .. 2**31 - 1), equal on every rank of one call.
    ``warm_up``: compile and launch with no work (no epoch, no flag), so that a later
    call does not compile while peers spin.
    """
    for label, t in (("x", x), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in DTYPES:
            raise TypeError(f"oneshot_wht6: {label} must be a 2-D tensor of {DTYPES}")
        if t.numel() and t.stride(1) != 1:
            raise ValueError(f"oneshot_wht6: {label} needs unit column stride")
    if x.shape != out.shape or x.dtype != out.dtype:
        raise ValueError(f"oneshot_wht6: out {tuple(out.shape)} {out.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    size = len(pubs)
    if not 1 <= size <= MAX_RANKS or len(flags) != size:
        raise ValueError(f"oneshot_wht6: need 1..{MAX_RANKS} payload buffers and as many flag "
                         f"arrays, got {size} and {len(flags)}")
    # The kernel's pointer arithmetic follows each argument's dtype.
    for label, group, dtype in (("pubs", pubs, torch.uint8), ("flags", flags, torch.int64),
                                ("own", [own] if own is not None else [], torch.uint8),
                                ("err", [err], torch.int64)):
        if any(getattr(a, "dtype", None) != dtype for a in group):
            raise TypeError(f"oneshot_wht6: {label} must be {dtype} (tensors or kernel_pointer)")
    if not 0 <= rank < size:
        raise ValueError(f"oneshot_wht6: rank {rank} outside 0..{size - 1}")
    if not isinstance(ctas, int) or ctas < 1:
        raise ValueError(f"oneshot_wht6: ctas must be an int >= 1, got {ctas!r}")
    if not isinstance(sig, int) or not 0 < sig < 2 ** 31:
        raise ValueError(f"oneshot_wht6: sig must be an int in 1..2**31-1, got {sig!r}")
    rows, cols = x.shape
    row_bytes = payload_bytes_per_row(cols) if cols else 0
    if rows * row_bytes > region_bytes or region_bytes % 8:
        raise ValueError(f"oneshot_wht6: payload of {rows}x{cols} needs {rows * row_bytes} B, "
                         f"region is {region_bytes} B (a multiple of 8 is required)")
    n_sub = 0 if warm_up else rows * padded_cols(cols) // SUB
    if n_sub >= 2 ** 31:
        raise ValueError(f"oneshot_wht6: {rows}x{cols} is over 2**36 values; split the call")
    if n_sub == 0 and not warm_up:
        return
    sync, timer = modes(x.device)
    bound = int(timeout_ms * 1e6) if timer else int(timeout_ms * ITERS_PER_MS)
    pad = MAX_RANKS - size
    _kernel()[(ctas,)](
        x, out, *pubs, *([pubs[0]] * pad), *flags, *([flags[0]] * pad),
        own if own is not None else pubs[rank], err, rank, n_sub, padded_cols(cols) // SUB,
        cols, max(x.stride(0), 1), max(out.stride(0), 1), row_bytes // 8, region_bytes,
        max(bound, 1), sig, W=size, T=SUBS_PER_PROGRAM, SPLITS_IN=_SPLITS_IN[x.dtype],
        SPLITS_OUT=_SPLITS_OUT[x.dtype], DOT_FP32=sync == 0, OWN_COPY=own is not None,
        SYNC=sync, TIMER=timer, enable_fp_fusion=False)
