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

Math and wire format are the wht6 codec's (``radiance_ar/wht6/__init__.py``): a payload
row is ``25 cols / 32`` bytes (6.25 bits/value); P_r is this rank's own payload read
back (from ``own`` or its published region), never its unquantized input, so every rank
sums the same W payloads in the same order 0..W-1 and gets the same bits. A tile is T
sub-blocks of 32 values in row-major order, encoded and decoded by the codec's own
helpers (``radiance_ar.wht6.wht6_tile``), so a payload and a sum are bit for bit those
of ``wht6_encode`` and ``wht6_decode_accumulate``. Rows whose
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
cols, dtype and the op's M and K: :mod:`radiance_ar.call_contract`) in the slot of the
call's parity. A waiter that sees its peer's flag reach ``t`` reads the slot of parity
``t``: another signature, or a flag beyond ``t + 1`` (the peer is in another call),
writes ``err[2] = 2`` (a mismatch) and what it read, ``err[3]`` the flag and ``err[4]`` the
slot, and the host raises ``CollectiveMismatchError``. The bound is
``%globaltimer`` nanoseconds since the CTA began waiting, on NVIDIA; elsewhere a count
of flag reads per peer (``ITERS_PER_MS`` per millisecond: a read of peer or host memory
takes about 1 us; a faster read shortens the bound, never lengthens it).

Ordering per platform (``sync`` mode): NVIDIA: PTX ``ld.acquire.sys`` / ``st.release.sys``
by every thread (plain loads and stores: no read-modify-write on host memory, which PCIe
does not make atomic); ROCm: Triton atomics (a CAS that never matches, an exchange);
the Triton interpreter (programs run one after another): plain volatile loads and stores.

The launch front end is ``radiance_ar.backends.kernels.oneshot_wht6`` (no Triton import); it imports
this module at its first launch. Launches use ``enable_fp_fusion=False``, as the codec's
kernels do.
"""

import triton
import triton.language as tl

from radiance_ar.wht6 import wht6_tile, wht6_tile_decode, wht6_tile_encode


@triton.jit
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


@triton.jit
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


@triton.jit
def _store_flag(ptr, value, SYNC: tl.constexpr):
    if SYNC == 1:
        tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,l", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
    elif SYNC == 2:
        tl.atomic_xchg(ptr, value.to(tl.int64), sem="release", scope="sys")
    else:
        tl.store(ptr, value)


@triton.jit
def _clock(TIMER: tl.constexpr):
    if TIMER:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
    else:
        now = tl.full([], 0, tl.int64)
    return now


@triton.jit(do_not_specialize=["rank", "n_sub", "region_bytes", "timeout", "sig"])
def oneshot_wht6_kernel(
    x_ptr,              # this rank's slice [rows, cols], unit column stride
    out_ptr,            # the reduced slice [rows, cols], same dtype
    pub0, pub1, pub2, pub3, pub4, pub5, pub6, pub7,  # *u8 every rank's payload buffer
                        # (two regions of region_bytes), rank order; unused repeat pub0
    flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7,  # *i64 every rank's 3 G words:
                        # G epoch flags, then 2 G call signatures (parity t mod 2);
                        # rank order; unused repeat flag0
    own_ptr,            # *u8 private copy of this rank's payload (read if OWN_COPY)
    err_ptr,            # *i64 [5] error words: epoch, peer + 1, kind (1 timeout, 2 mismatch),
                        # the peer's flag and its signature slot as read (a mismatch)
    levels,             # *fp32 [64] the codec's dequantization factors (wht6_launch.levels)
    rank,               # this rank, 0..W-1
    n_sub,              # rows * cols_padded / 32 sub-blocks; 0 = warm-up, touches nothing
    subs_per_row,       # cols_padded / 32
    cols,               # real columns (the rest of a padded row is zeros)
    x_row_stride,       # elements between rows of x
    out_row_stride,     # elements between rows of out
    pay_row_bytes,      # payload row stride in bytes (25 cols_padded / 32)
    region_bytes,       # bytes of one payload region (a multiple of 8)
    timeout,            # spin bound: nanoseconds (TIMER) or flag reads
    sig,                # this call's signature hash (> 0): every rank's must be equal
    W: tl.constexpr,         # ranks, 1..8
    T: tl.constexpr,         # sub-blocks per tile, a multiple of 32 * num_warps
    PADDED: tl.constexpr,      # cols is not a multiple of 256 (mask the padding columns)
    NV_SQRT: tl.constexpr,     # NVIDIA's sqrt fast path (wht6_tile): CUDA only
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
            # int32 indices: launch checks n_sub < 2**31; the helpers widen addresses
            row, j, ok = wht6_tile.tile_of(tile, T, n_sub, subs_per_row)
            x0, x1, x2, x3 = wht6_tile.load_values(x_ptr, row, j, ok, x_row_stride, cols, PADDED)
            nib, high, rec = wht6_tile_encode.encode_tile(x0, x1, x2, x3, T, NV_SQRT)
            wht6_tile.store_payload(my_pub + region, row, j, ok, subs_per_row, pay_row_bytes,
                                    nib, high, rec)
            if OWN_COPY:
                wht6_tile.store_payload(own_ptr, row, j, ok, subs_per_row, pay_row_bytes,
                                        nib, high, rec)
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
                            tl.store(err_ptr + 3, seen)
                            tl.store(err_ptr + 4, their)
            tl.debug_barrier()
            own_src = my_pub + region
            if OWN_COPY:
                own_src = own_ptr
            for tile in range(pid, n_tiles, ctas):
                row, j, ok = wht6_tile.tile_of(tile, T, n_sub, subs_per_row)
                src = pub0 + region
                if rank == 0:
                    src = own_src
                a0, a1, a2, a3, sbits = wht6_tile_decode.load_dequantize(
                    src, row, j, ok, subs_per_row, pay_row_bytes, levels, False)
                for p in tl.static_range(1, W):
                    src = _nth(p, pub0, pub1, pub2, pub3, pub4, pub5, pub6, pub7) + region
                    if p == rank:
                        src = own_src
                    b0, b1, b2, b3, bits = wht6_tile_decode.load_dequantize(
                        src, row, j, ok, subs_per_row, pay_row_bytes, levels, False)
                    a0 += b0
                    a1 += b1
                    a2 += b2
                    a3 += b3
                    sbits = tl.maximum(sbits, bits)
                x0, x1, x2, x3 = wht6_tile_decode.decode_tile(a0, a1, a2, a3, sbits,
                                                       out_ptr.dtype.element_ty, T)
                wht6_tile.store_values(out_ptr, row, j, ok, out_row_stride, cols,
                                       x0, x1, x2, x3, PADDED)
