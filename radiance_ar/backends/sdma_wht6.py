"""``sdma_wht6``: the copy-engine transport moving wht6 payloads -- codec bytes, DMA waits.

The byte savings of the 6.25-bit codec (:mod:`radiance_ar.wht6`) with a wait that costs no
compute units on NVIDIA (one work-item per wait on ROCm: :mod:`radiance_ar.transport.hip_ops`):
encode this rank's slice on the CUs into its peer-visible buffer (where that is host memory:
into its device stage, in the op on the GEMM's stream: :meth:`encode_ahead`), let the copy
engines pull peers' payloads (stream wait-value on the peer's flag, then a copy: no kernel
spins on NVIDIA; :mod:`radiance_ar.transport.copy_transport`), decode on the CUs. Every rank decodes the
same payloads in the same order, so every rank holds identical bits. In plain torch,
with ``q = lambda x: decode(encode(x))`` and ``dq_sum`` the codec's decode-accumulate
of the W encoded slices in rank order (fp32, one inverse rotation, rounded once)::

    out = dq_sum(slice_in of every rank)         # one-shot
    out = q(dq_sum(slice_in of every rank))      # two-shot: quantized a second time

Schedules (``settings.sdma_schedule``, from ``RADIANCE_AR_SDMA_SCHEDULE``; ``auto``:
:func:`radiance_ar.backends.sdma_schedule.auto_schedule_wht6`, which also gives the byte counts).

One-shot, rank r, epoch t: every peer's whole payload::

    stream r : fence | encode(slice) -> pub_r (host buffers: -> stage, D2H -> pub_r)
               | ready_r = t | for p: wait ready_p == t, pull pub_p -> recv_p
               | done_r = t | decode_accumulate(pub_r, recv_p.. in rank order) -> out

Host buffers, in the op: the encode runs on the GEMM's stream right after GEMM slice s,
into rows ``b_s:b_s+1`` of the stage (which holds the whole call; no peer reads it, so no
fence orders it), and the call begins with the fenced D2H publish of those rows. On the
all-reduce's stream it would wait for GEMM slice s+1, a persistent kernel holding every SM
until it ends: at W = 2, S = 4, M = 8192 the op ran 1.187 ms that way, 1.042 ms with the
encode ahead (H200, tools/results/2026-12-05-h200-encode-ahead/). Such a call also
receives, and (two-shot) gathers, at its own rows' offset, so its last decode, which waits
for the SMs of the GEMM slice then running, runs on the decode lane and the next slice's
pulls need not wait for it (:mod:`radiance_ar.transport.side_lanes`).

Two-shot, rank r, epoch t; payload rows are cut into W shards (``row_shards``; payload
row i encodes output row i only, so a shard is a payload of its own)::

    stream r : fence | encode(slice) -> pub_r | ready_r = t          (as one-shot)
               | for p: wait ready_p == t, pull shard r of pub_p -> recv_p
               | reduce_encode(shard r of pub_r, recv_p.. in rank order) -> G[shard r]
                 (= encode(decode_accumulate(...)), one kernel) | (host buffers: D2H -> red_r)
               | reduced_r = t | for p: wait reduced_p == t, pull shard p of red_p -> G[shard p]
               | done_r = t | decode(G) -> out

G, the gathered payload, is ``red_r`` itself where it is this rank's memory (gpu-symm,
CPU worlds) and its device stage where buffers are host memory (gpu-emulated, gpu-host):
every shard sits at its own rows there, in ``red`` as in G, so ONE decode of all rows ends
the call (3 codec launches whatever W: encode, reduce-encode, decode; decoding shard by
shard would take 2 + W). Peers read only rows ``shard r`` of ``red_r``; the other rows
take this rank's pulls. Rank r decodes its own re-encoded shard too, so out =
decode(encode(sum)) holds the same bits on every rank. ``red`` is written after the
call's fence of ``pub`` (payloads start at offset 0 of ``pub``, so the fence orders
each call after every peer's last pull, of either buffer, of the call before).

wire_bytes: one-shot (W-1) x payload bytes = (W-1) x numel x 25/32 (39% of sdma
one-shot's); two-shot, per rank, (W-1) x its shard + the W-1 other shards, about
2(W-1)/W x payload bytes (exactly :func:`~radiance_ar.backends.sdma_schedule.wht6_twoshot_wire_bytes`).

Error bounds (``rel_rms_bound``, relative RMS error against the float64 sum, on
Gaussian-like data). Let S be the exact sum, S1 = dq_sum(...) and S2 = q(S1):

- one-shot: ``ONESHOT_REL_RMS_BOUND = wht6.SUM_REL_RMS_BOUND = 2^-5``.
- two-shot: ``TWOSHOT_REL_RMS_BOUND = B_sum + B_1 (1 + B_sum) = 2^-4 + 2^-10`` (0.0635),
  with B_sum = ``wht6.SUM_REL_RMS_BOUND`` bounding ||S1 - S|| / ||S|| and B_1 the bound
  of ONE payload, decode(encode(x)) against x: ``wht6.SUM_REL_RMS_BOUND`` again, the
  sum of one payload (the codec's tests hold a single round trip to it; one payload's
  measured error, 0.021 on Gaussian data, is what the codec's sum bound rests on).
  ||S2 - S1|| <= B_1 ||S1|| and ||S1|| <= (1 + B_sum) ||S||, so the triangle
  inequality gives the bound. It is a worst case: the two quantizations' errors are
  independent and add in quadrature. Measured with the CPU reference codec (1024 x 5120
  Gaussian bf16 per rank, W = 2, 4, 8): 0.021 one-shot, 0.0297 two-shot (1.41x).

An instance's ``rel_rms_bound`` is the bound of every schedule it may run (``auto`` from
W = 4 on: the two-shot bound, as it picks two-shot for large payloads); the class
attribute is the larger, true of every instance.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch

from radiance_ar import wht6
from radiance_ar.envs import OVERLAP_PLANS, BackendSettings
from radiance_ar.backends.interface import check_capacity_args, check_slice, copy_unless_same
from radiance_ar.buffers import refuse_growth_in_capture
from radiance_ar.backends.registry import register
from radiance_ar.backends.sdma_schedule import (SHARD_ALIGN_BYTES, WHT6_TWOSHOT_MIN_WORLD,
    auto_schedule_wht6, row_shards, wht6_twoshot_wire_bytes)
from radiance_ar.streams import current_stream_handle
from radiance_ar.transport import passive_peers
from radiance_ar.transport.trace import traced
from radiance_ar.backends.transport_backend import TransportBackend
from radiance_ar.transport.world import World

ONESHOT_REL_RMS_BOUND = wht6.SUM_REL_RMS_BOUND
#: one payload's bound (decode(encode(x)) against x): a decode-accumulate of one payload
PAYLOAD_REL_RMS_BOUND = wht6.SUM_REL_RMS_BOUND
TWOSHOT_REL_RMS_BOUND = ONESHOT_REL_RMS_BOUND + PAYLOAD_REL_RMS_BOUND * (1 + ONESHOT_REL_RMS_BOUND)
REL_RMS_BOUNDS = {"oneshot": ONESHOT_REL_RMS_BOUND, "twoshot": TWOSHOT_REL_RMS_BOUND}


def stage_pitch(row_bytes: int) -> int:
    """Bytes per row of the call in the stage where slices are encoded ahead: a payload
    row's bytes rounded up to ``SHARD_ALIGN_BYTES``, so each slice's payload starts on a
    16-byte boundary whatever its first row (a row is 8 bytes off where cols / 256 is
    odd): the codec kernels then see the alignment of every other call, for the reason
    ``SHARD_ALIGN_BYTES`` gives (a new Triton variant compiled while a peer waits)."""
    return -(-row_bytes // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES


@register("sdma_wht6")
class SdmaWht6Backend(TransportBackend):
    bit_exact = False  # quantized; still identical bits on every rank
    quantized = True  # wht6 payloads (6.25 bits/value)
    rel_rms_bound = TWOSHOT_REL_RMS_BOUND  # the larger; each instance sets its schedule's
    peer_visible_input = False  # the GEMM writes scratch; the payload is what peers read
    stage_reduced = True  # host buffers: the re-encoded shard is written to device memory first
    world_limit = f"decode_accumulate's limit of {wht6.MAX_PAYLOADS} payloads"
    preferred_slices = 1  # one rank: nothing to overlap
    decodes_beside = True  # an op call's slices end with a decode (see _all_reduce)

    #: at W = 2, ``auto`` cuts a call into uniform slices of about this many rows (below)
    rows_per_auto_slice: ClassVar[int] = 1024
    #: ... and into at most this many slices
    max_auto_slices: ClassVar[int] = 8

    @classmethod
    def preferred_slices_for(cls, world_size: int, rows: int, plan: str) -> int:
        # Replayed op calls with the decode lane on an H100, emulated ranks, N = 5120, S = 1,
        # 2, 4, 8 (tools/results/2026-12-05-h100-slices/): at W = 2 the fastest S was 2 at
        # M = 2048 (0.293 ms; S = 8 0.339), 4 at 4096 (0.517; S = 2 0.561), 8 at 8192 (0.945;
        # S = 4 0.956, S = 2 1.065) and at 16384 (1.775; S = 4 1.968): one slice per 1024
        # rows, a power of two in [2, 8]. The H200 agrees at 8192 (S = 8 0.895, S = 4 0.922,
        # S = 2 1.030 ms: ../2026-12-05-h200-decode-lane/). At W = 4 (two-shot per slice)
        # S = 2 was fastest at every M (1.514 ms at 8192 against 1.546 at S = 4). W = 3
        # (not measured) takes W = 4's. Those were uniform slices; growing ones keep the
        # S = 2 that the H200 tune chose for them (../2026-12-04-h200-tune/, W = 2: S = 2
        # growing fastest at M = 2048 and 8192), as S = 8 growing would leave half the rows
        # to the last slice.
        if world_size < 2:
            return cls.preferred_slices
        if world_size > 2 or plan != OVERLAP_PLANS[0]:
            return 2
        per_rows = max(rows // cls.rows_per_auto_slice, 1)
        return min(max(1 << (per_rows.bit_length() - 1), 2), cls.max_auto_slices)

    def __init__(self, world: World, settings: BackendSettings | None = None, *,
                 schedule: str | None = None):
        """``settings``: ``sdma_schedule`` and ``spin_timeout_ms`` (default: the
        environment's); ``schedule`` fixes the schedule, checked alike."""
        super().__init__(world, settings, schedule=schedule)
        self.rel_rms_bound = REL_RMS_BOUNDS[
            "twoshot" if world.size > 1 and self.may_use_twoshot() else "oneshot"]
        self.cols = 0  # columns of the last ensure_capacity (payload rows, timing fill)
        #: (cols, dtype) whose codec kernels are loaded: every shape once, so that a
        #: captured op call of an earlier width never has to load one (refused in capture)
        self._warm: set[tuple[int, torch.dtype]] = set()

    def may_use_twoshot(self) -> bool:
        # auto: two-shot for large payloads from WHT6_TWOSHOT_MIN_WORLD ranks on
        return self.schedule == "twoshot" or (self.schedule == "auto" and
                                              self.world.size >= WHT6_TWOSHOT_MIN_WORLD)

    @classmethod
    def unsupported_cols_reason(cls, cols: int) -> str | None:
        return wht6.cols_reason(cols)

    def schedule_for(self, payload_bytes: int) -> str:
        """The schedule of a call moving payloads of ``payload_bytes`` (auto resolved)."""
        return (auto_schedule_wht6(payload_bytes, self.world.size) if self.schedule == "auto"
                else self.schedule)

    def call_schedule(self, rows: int, cols: int, dtype: torch.dtype) -> str | None:
        return (self.schedule_for(wht6.payload_bytes(rows * cols)) if self.world.size > 1
                else None)

    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        """Bytes THIS rank pulls per call of ``numel`` values, whatever their dtype.
        Two-shot shards by rows of ``cols`` (the last ``ensure_capacity``'s), so its
        count is this rank's in its own world: another ``world_size`` is refused there."""
        if world_size < 2:
            return 0
        payload = wht6.payload_bytes(numel)
        auto = self.schedule == "auto"
        schedule = auto_schedule_wht6(payload, world_size) if auto else self.schedule
        if schedule == "oneshot":
            return (world_size - 1) * payload
        if world_size != self.world.size:
            raise ValueError(f"sdma_wht6.wire_bytes: two-shot counts this rank's bytes in "
                             f"its world of {self.world.size} ranks, got world_size={world_size}")
        if self.cols == 0 or numel % self.cols:
            raise ValueError(f"sdma_wht6.wire_bytes: {numel} values are not whole rows of "
                             f"cols={self.cols} (call ensure_capacity first)")
        return wht6_twoshot_wire_bytes(numel // self.cols, wht6.payload_bytes_per_row(self.cols),
                                       world_size, self.world.rank)

    def ensure_capacity(self, max_rows: int, cols: int, dtype: torch.dtype) -> None:
        check_capacity_args(self.name, max_rows, cols, dtype)
        rows, row_bytes = wht6.payload_shape(max_rows, cols)
        if ((cols, dtype) not in self._warm
                and self.world.device.type == "cuda" and self.world.size > 1):
            self._warm_codec(cols, dtype)
            self._warm.add((cols, dtype))
        # the whole call at the stage's pitch (encode_ahead), which also bounds one call
        self.transport.ensure_capacity(rows * stage_pitch(row_bytes))
        self.cols = cols  # after a growth that may be refused

    def _warm_codec(self, cols: int, dtype: torch.dtype) -> None:
        """Compile and load the codec kernels now, for the reason given in
        :func:`radiance_ar.backends.kernels.reduce_sum.warm_up` (a first module load can synchronize
        the device while an emulated rank's stream waits on a flag). Triton compiles one
        variant per divisibility of ``n_sub = rows * cols / 32`` by 16: 1 and 2 rows give
        both where both exist. Warming 1 row only leaves a variant to compile at a first
        call, while a rank's stream may wait on a peer (docs/history.md). Two-shot also
        decodes ONE payload (a variant of its own: Triton specializes an argument of 1),
        and reduces and encodes W."""
        refuse_growth_in_capture("sdma_wht6 codec warm-up", self.world.device)
        twoshot = self.may_use_twoshot()
        counts = {self.world.size} | ({1} if twoshot else set())
        for rows in (1, 2):
            x = torch.zeros(rows, cols, dtype=dtype, device=self.world.device)
            payload = wht6.encode(x)
            for n in sorted(counts):
                wht6.decode_accumulate([payload] * n, (rows, cols), dtype)
            if twoshot:
                wht6.reduce_encode([payload] * self.world.size, (rows, cols), dtype)
        torch.cuda.synchronize(self.world.device)

    def all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor) -> None:
        self._all_reduce(slice_in, out, None)

    def encode_ahead(self, slice_in: torch.Tensor, row0: int) -> torch.Tensor | None:
        """Where the buffers are host memory (gpu-emulated, gpu-host), encode the slice
        into the device stage at its own rows of the call (from byte ``row0`` x
        :func:`stage_pitch`: the stage holds the whole call, ``ensure_capacity(M, ...)``,
        and each slice starts 16-byte aligned), which no peer reads, so no
        fence orders it; the all-reduce's publish copies it D2H after the fence. Where
        ``pub`` is this rank's memory the encode writes what peers read, after the fence
        (``None``: done in :meth:`all_reduce`)."""
        tr = self.transport
        if self.world.size == 1 or not tr.buffers.staged:
            return None  # wht6.encode checks the slice; the all-reduce checks it again
        rows, row_bytes = wht6.payload_shape(*slice_in.shape)
        start = row0 * stage_pitch(row_bytes)
        tr.check_fits(start + rows * row_bytes)
        encoded = tr.buffers.source("pub")[start:start + rows * row_bytes].view(rows, row_bytes)
        with traced(tr.trace, current_stream_handle(slice_in.device), "encode"):
            wht6.encode(slice_in, out=encoded)
        return encoded

    def all_reduce_ahead(self, slice_in: torch.Tensor, out: torch.Tensor,
                         ahead: torch.Tensor) -> None:
        assert ahead.shape == wht6.payload_shape(*slice_in.shape), (ahead.shape, slice_in.shape)
        self._all_reduce(slice_in, out, ahead)

    def _all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor,
                    ahead: torch.Tensor | None) -> None:
        """:meth:`all_reduce`; ``ahead``: this rank's payload, already encoded into the
        stage (:meth:`encode_ahead`), else ``None``."""
        tr = self.transport
        with self.checking_call():
            check_slice(slice_in, out)
            rows, cols = slice_in.shape
            if self.world.size > 1:
                shape = wht6.payload_shape(rows, cols)
                nbytes = tr.check_fits(shape[0] * shape[1])
        if self.world.size == 1:
            copy_unless_same(slice_in, out)
            return
        # Encoded ahead, the call owns its rows of the stage from byte `own`: it receives
        # and gathers there too, so its last decode may run beside the next slice's
        # pulls (CopyTransport.decode_beside); else every call uses bytes from 0.
        own = (None if ahead is None
               else ahead.data_ptr() - tr.buffers.source("pub").data_ptr())
        with tr.call_stream() as stream, self.signals.call(self.signature(slice_in)) as t:
            encoded = self._encode_and_publish(t, slice_in, shape, nbytes, stream, ahead)
            if self.schedule_for(nbytes) == "oneshot":
                pulled = tr.pull_all(t, 0, nbytes, stream, f"{self.name} one-shot all_reduce",
                                     at=own)
                payloads = [encoded if q == self.world.rank else pulled[q].view(shape)
                            for q in range(self.world.size)]
                with self._last_decode(stream, own) as on, \
                        traced(tr.trace, on, "decode_accumulate"):
                    wht6.decode_accumulate(payloads, (rows, cols), out.dtype, out=out)
            else:
                self._twoshot(t, encoded, out, stream, own)
            tr.finish(t, 0, nbytes, stream)

    def _last_decode(self, stream: int, own: int | None) -> contextlib.AbstractContextManager[int]:
        """Where a call's last decode runs (yields the handle): beside the next call where
        the call owns its bytes (``own``, see :meth:`_all_reduce`), else on ``stream``."""
        if own is None:
            return contextlib.nullcontext(stream)
        return self.transport.decode_beside(stream)

    def fill_passive_peers(self) -> None:
        """Timing mode (see :meth:`radiance_ar.backends.sdma.SdmaBackend.fill_passive_peers`): every
        peer holds valid payloads of rows of ``cols`` columns in ``pub`` and ``red``
        (repeated whole rows from offset 0 are again a valid payload)."""
        if self.cols == 0:
            raise ValueError("sdma_wht6.fill_passive_peers: call ensure_capacity first")
        g = torch.Generator().manual_seed(0)
        values = torch.randn(64, self.cols, generator=g).to(torch.bfloat16)
        passive_peers.make_passive(self.transport, wht6.encode(values))

    # ------------------------------------------------------------------ internals

    def _encode_and_publish(self, t: int, slice_in: torch.Tensor, shape: tuple, nbytes: int,
                            stream: int, encoded: torch.Tensor | None) -> torch.Tensor:
        """Encode ``slice_in`` into this rank's payload (fenced) unless ``encoded`` holds
        it already (:meth:`encode_ahead`), and publish it as call ``t``'s ``ready``;
        returns the local payload."""
        tr = self.transport
        if encoded is None:
            if not tr.buffers.staged:  # the encode below writes the peer-visible buffer itself
                tr.fence(0, nbytes, stream)
            encoded = tr.buffers.source("pub")[:nbytes].view(shape)
            with traced(tr.trace, stream, "encode"):
                wht6.encode(slice_in, out=encoded)
        if tr.buffers.staged:  # the D2H publish, fenced (on the publish lane where there is one)
            tr.publish(t, "ready", 0, encoded.data_ptr(), nbytes, stream, fence=(0, nbytes))
        else:
            self.signals.post("ready", t, stream)
        return encoded

    def _twoshot(self, t: int, encoded: torch.Tensor, out: torch.Tensor, stream: int,
                 own: int | None) -> None:
        """Phases 2-4 of the two-shot schedule (module doc), after the publish; ``own``:
        where the call's own bytes of the stages and receive slots start (None: 0)."""
        tr, r, size = self.transport, self.world.rank, self.world.size
        rows, cols = out.shape
        rb = encoded.shape[1]
        bounds = row_shards(rows, size, rb)
        lo, hi = bounds[r], bounds[r + 1]
        what = f"{self.name} two-shot all_reduce"
        at = own or 0
        # Compressed reduce-scatter: shard r of every payload, summed in rank order.
        got = {p: tr.buffers.recv_slot(p, (hi - lo) * rb, at).view(hi - lo, rb)
               for p in tr.peers}
        tr.pull_from("ready", t, [(p, got[p].data_ptr(), lo * rb, (hi - lo) * rb)
                                  for p in tr.peers], stream, what)
        # The gathered payload: every rank's re-encoded shard at its own rows, so one
        # decode ends the call. Mine is reduced and encoded into it (one kernel: each
        # launch here waits for the SMs of the GEMM slice then running, in the op) and
        # published from it.
        gathered = tr.buffers.source("red")[at:at + rows * rb].view(rows, rb)
        if hi > lo:
            shards = [encoded[lo:hi] if q == r else got[q] for q in range(size)]
            with traced(tr.trace, stream, "reduce and encode"):
                wht6.reduce_encode(shards, (hi - lo, cols), out.dtype, out=gathered[lo:hi])
        tr.publish(t, "reduced", lo * rb if tr.buffers.staged else None,
                   gathered.data_ptr() + lo * rb, (hi - lo) * rb, stream)
        # Compressed all-gather: every peer's re-encoded shard into its rows.
        base = gathered.data_ptr()
        tr.pull_from("reduced", t, [(p, base + bounds[p] * rb, bounds[p] * rb,
                                     (bounds[p + 1] - bounds[p]) * rb) for p in tr.peers],
                     stream, what)
        tr.post_done(t, stream)
        with self._last_decode(stream, own) as on, traced(tr.trace, on, "decode reduced"):
            wht6.decode_accumulate([gathered], (rows, cols), out.dtype, out=out)
