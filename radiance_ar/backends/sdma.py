"""``sdma``: all-reduce by DMA copies (no compute units while waiting on NVIDIA) + one reduce.

Each rank's slice sits in its peer-visible buffer ``pub`` (the GEMM writes there through
``acquire_input_view``); peers PULL it with copy-engine copies after a stream wait-value
on its ``ready`` flag (the transport: :mod:`radiance_ar.transport.copy_transport`, whose module doc
draws one call and the reuse fence), then one short reduce kernel sums in rank order
0..W-1 with fp32 accumulation, rounded once (:mod:`radiance_ar.backends.kernels.reduce_sum`):
bit-exact and identical on every rank. In plain torch::

    out = sum(slice_in on rank r for r in range(W)).to(dtype)   # fp32 adds in rank order

Schedules (``settings.sdma_schedule``, from ``RADIANCE_AR_SDMA_SCHEDULE``, or the
``schedule`` argument, which fixes one): one-shot, two-shot or auto, as
:mod:`radiance_ar.backends.sdma_schedule` defines them. Two-shot, rank r (epoch t)::

    fence | publish ready_r=t | for p: wait ready_p, pull shard r of pub_p | reduce -> out[r]
          | publish out[r] -> red_r, reduced_r=t | for p: wait reduced_p, pull red_p -> out[p]
          | done_r=t

The fence runs once per op call (in ``acquire_input_view``: the rows of one op call's
slices are disjoint) or where a direct ``all_reduce`` reuses bytes (tracked per epoch).
In gpu-symm the two-shot reduce kernel writes the reduced shard into ``red`` itself.
Emulated ranks: ``ensure_capacity`` loads the reduce kernels and must run on every rank
before the first ``all_reduce`` (the transport's module doc says why).
"""

from __future__ import annotations

import torch

from radiance_ar.transport.call_streams import Footprint
from radiance_ar.transport.copy_engine import host_array
from radiance_ar.envs import BackendSettings
from radiance_ar.backends.interface import check_capacity_args, check_slice, copy_unless_same
from radiance_ar.buffers import refuse_growth_in_capture
from radiance_ar.transport.peer_memory import typed_view
from radiance_ar.backends.registry import register
from radiance_ar.backends.sdma_schedule import auto_schedule, schedule_wire_bytes, shard_bounds
from radiance_ar.transport import passive_peers
from radiance_ar.transport.trace import traced
from radiance_ar.backends.transport_backend import TransportBackend
from radiance_ar.transport.world import World


@register("sdma")
class SdmaBackend(TransportBackend):
    bit_exact = True
    # One rounding of the fp32 sum: relative error <= 2^-8 (bf16 unit roundoff) per element.
    rel_rms_bound = 2.0 ** -8
    peer_visible_input = True
    uses_call_streams = True
    preferred_slices = 4

    @classmethod
    def preferred_slices_for(cls, world_size: int, rows: int, plan: str) -> int:
        # The H200 tune of replayed op calls (tools/results/2026-12-04-h200-tune/, emulated
        # ranks, N = 5120 and 8192, M = 2048-16384): at W = 2, S = 4 is fastest from M =
        # 8192 (1.971 ms against 2.018 at S = 8 and 2.252 at S = 1, N = 5120, M = 8192);
        # at W = 4, S = 2 is fastest at every M but 12288 x 8192 (2.787 ms against 2.852
        # at S = 4 and 3.030 at S = 1, N = 5120, M = 8192). The same S at every M and plan.
        return cls.preferred_slices if world_size <= 2 else 2

    def __init__(self, world: World, settings: BackendSettings | None = None, *,
                 schedule: str | None = None):
        """``settings``: ``sdma_schedule`` and ``spin_timeout_ms`` (default: the
        environment's). ``schedule`` fixes the schedule whatever the settings say (a
        probe of one schedule); checked alike."""
        super().__init__(world, settings, schedule=schedule)
        self._warm: set[torch.dtype] = set()  # dtypes whose reduce kernels are loaded

    # ------------------------------------------------------------------ contract

    def schedule_for(self, nbytes: int) -> str:
        return (auto_schedule(nbytes, self.world.size) if self.schedule == "auto"
                else self.schedule)

    def call_schedule(self, rows: int, cols: int, dtype: torch.dtype) -> str | None:
        return self.schedule_for(rows * cols * dtype.itemsize) if self.world.size > 1 else None

    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        return schedule_wire_bytes(self.schedule, numel * elem_size, world_size)

    def ensure_capacity(self, max_rows: int, cols: int, dtype: torch.dtype) -> None:
        check_capacity_args("sdma", max_rows, cols, dtype)
        if dtype not in self._warm and self.world.size > 1 and self.world.device.type == "cuda":
            from radiance_ar.backends.kernels import reduce_sum as kernel

            refuse_growth_in_capture("sdma reduce kernel warm-up", self.world.device)
            kernel.warm_up(self.world.size, dtype, self.world.device,
                           with_also=self.world.kind == "gpu-symm")
            self._warm.add(dtype)
        self.transport.ensure_capacity(max_rows * cols * dtype.itemsize)

    def acquire_input_view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        need = rows * cols * dtype.itemsize
        tr = self.transport
        with self.checking_call():
            if need > tr.capacity:
                raise ValueError(f"sdma.acquire_input_view: {rows}x{cols} {dtype} needs {need} "
                                 f"B, capacity is {tr.capacity} B: call ensure_capacity first")
        if self.signals is not None:
            self.signals.refuse_if_faulted()
            try:
                with tr.call_stream() as stream, traced(tr.trace, stream, "fence"):
                    tr.fence(0, tr.capacity, stream)
            except BaseException as e:
                self.signals.fail(e)
                raise
        return typed_view(tr.buffers.source("pub"), rows, cols, dtype)

    def all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor) -> None:
        tr = self.transport
        with self.checking_call():
            check_slice(slice_in, out)
            if self.world.size > 1:
                nbytes = tr.check_fits(slice_in.numel() * slice_in.element_size())
                off, staged = self._placement(slice_in)
                schedule = self.schedule_for(nbytes)
                self._check_out(out, nbytes, schedule)
        if self.world.size == 1:
            copy_unless_same(slice_in, out)
            return
        local, out_addr = slice_in.data_ptr(), out.data_ptr()
        footprint = Footprint(off, off + nbytes, local, local + nbytes, out_addr, out_addr + nbytes)
        with tr.call_stream() as caller, self.signals.call(self.signature(slice_in)) as t, \
                tr.on_call_stream(caller, footprint) as stream:
            self._publish(t, off, staged, local, nbytes, stream)
            if schedule == "oneshot":
                tr.pull_all(t, off, nbytes, stream, f"{self.name} one-shot all_reduce")
                self._reduce([local if q == self.world.rank else tr.buffers.recv_address(q, off)
                              for q in range(self.world.size)], out_addr, out.numel(),
                             out.dtype, stream)
            else:
                self._twoshot(t, off, local, out, stream)
            tr.finish(t, off, nbytes, stream)

    # ------------------------------------------------------------------ timing helpers

    def exchange_only(self, slice_in: torch.Tensor) -> list[torch.Tensor]:
        """The transport half of a one-shot call, no reduce: publish, flags, W-1 pulls.

        Returns the received peer slices (uint8, rank order, own slot empty). Used by
        :mod:`radiance_ar.diagnostics.cu_free_check` to prove the transport progresses with every SM held.
        """
        if self.world.size == 1:
            return []
        tr = self.transport
        nbytes = tr.check_fits(slice_in.numel() * slice_in.element_size())
        off, staged = self._placement(slice_in)
        with tr.call_stream() as stream, self.signals.call(self.signature(slice_in)) as t:
            self._publish(t, off, staged, slice_in.data_ptr(), nbytes, stream)
            ops = tr.pull_all(t, off, nbytes, stream, f"{self.name} one-shot all_reduce")
            tr.finish(t, off, nbytes, stream)
        return [ops.get(q, slice_in.new_empty(0, dtype=torch.uint8))
                for q in range(self.world.size)]

    def fill_passive_peers(self, payload: torch.Tensor | None = None, seed: int = 0) -> None:
        """Timing mode: make every OTHER rank a passive peer that never calls.

        Fills each peer's ``pub`` (and ``red``) with ``payload``'s bytes (repeated), or
        with normal bf16 values from ``seed`` (never zeros: they can time faster), and
        raises its flags to :data:`radiance_ar.transport.signals.PASSIVE_EPOCH`, so this rank's waits
        pass at once and its pulls move real bytes. Results are then NOT sums over ranks.
        Host writes: call after :meth:`ensure_capacity`, before timing, with no call in flight.
        """
        if self.capacity == 0:
            raise ValueError("sdma.fill_passive_peers: call ensure_capacity first")
        if payload is None:
            g = torch.Generator().manual_seed(seed)
            payload = torch.randn(self.capacity // 2, generator=g).to(torch.bfloat16)
        passive_peers.make_passive(self.transport, payload)

    # ------------------------------------------------------------------ internals

    def _placement(self, slice_in: torch.Tensor) -> tuple[int, bool]:
        """(byte offset of the slice in ``pub``, whether it is copied there): a slice the
        GEMM wrote into ``pub`` (``acquire_input_view``) stays at its offset; any other is
        staged at offset 0 (every rank alike). No work is enqueued."""
        tr = self.transport
        nbytes = slice_in.numel() * slice_in.element_size()
        base = tr.buffers.source("pub")
        off = slice_in.data_ptr() - base.data_ptr()
        inside = slice_in.device == base.device and 0 <= off and off + nbytes <= tr.capacity
        if inside and off % slice_in.element_size():
            raise ValueError("sdma.all_reduce: slice_in is misaligned inside the input buffer")
        return (off, tr.buffers.staged) if inside else (0, True)  # host buffers: the D2H publish

    def _check_out(self, out: torch.Tensor, nbytes: int, schedule: str) -> None:
        """One-shot sums into ``out`` right after its pulls, while peers may still be
        pulling this rank's bytes of ``pub``: ``out`` may not lie in the peer-visible
        ``pub`` (an in-place call on :meth:`acquire_input_view`'s view would hand a peer the
        sum instead of the slice). Two-shot waits for the peers' pulls first, and where the
        buffers are host memory ``out`` can only lie in the private stage."""
        pub = self.transport.buffers.pub.local
        lo, hi = pub.data_ptr(), pub.data_ptr() + pub.numel()
        start = out.data_ptr()
        if (schedule == "oneshot" and out.device == pub.device
                and start < hi and lo < start + nbytes):
            raise ValueError(f"{self.name}.all_reduce: out lies in the peer-visible input buffer, "
                             "which peers still read while a one-shot call sums into it; give "
                             "an out of its own")

    def _publish(self, t: int, off: int, staged: bool, addr: int, nbytes: int,
                 stream: int) -> None:
        """Publish call ``t``'s slice (``nbytes`` at ``addr``) at ``off`` of ``pub`` (a
        copy where ``staged``), after the reuse fence of those bytes; post ``ready``."""
        self.transport.publish(t, "ready", off if staged else None, addr, nbytes, stream,
                               fence=(off, off + nbytes))

    def _twoshot(self, t: int, off: int, local: int, out: torch.Tensor, stream: int) -> None:
        """Phases 2-4 of two-shot (module doc) by address: ``local`` is this rank's slice."""
        tr, r, e = self.transport, self.world.rank, out.element_size()
        bounds = shard_bounds(out.numel(), self.world.size, e)
        lo, hi = bounds[r], bounds[r + 1]
        what = f"{self.name} two-shot all_reduce"
        tr.pull_from("ready", t, [(p, tr.buffers.recv_address(p, off), off + lo * e, (hi - lo) * e)
                                  for p in tr.peers], stream, what)
        out_addr = out.data_ptr()
        operands = [local + lo * e if q == r else tr.buffers.recv_address(q, off)
                    for q in range(self.world.size)]
        if self.world.kind == "gpu-symm":
            # red is this GPU's memory: the kernel writes it too (no same-device D2D copy).
            self._reduce(operands, out_addr + lo * e, hi - lo, out.dtype, stream,
                         also=tr.buffers.local_address("red") + off + lo * e)
            self.signals.post("reduced", t, stream)
        else:
            self._reduce(operands, out_addr + lo * e, hi - lo, out.dtype, stream)
            # host copy / D2H publish into host memory (peers' shards land in out, disjoint)
            tr.publish(t, "reduced", off + lo * e, out_addr + lo * e, (hi - lo) * e, stream)
        tr.pull_from("reduced", t, [(p, out_addr + bounds[p] * e, off + bounds[p] * e,
                                     (bounds[p + 1] - bounds[p]) * e) for p in tr.peers],
                     stream, what)
        tr.post_done(t, stream)

    def _reduce(self, operands: list[int], out: int, n: int, dtype: torch.dtype, stream: int,
                also: int | None = None) -> None:
        """Sum the ``n``-element ``dtype`` arrays at ``operands`` (rank order) into ``out``
        (and ``also``) on ``stream``, the current stream; all by address."""
        if n == 0:
            return
        from radiance_ar.backends.kernels import reduce_sum as kernel

        with traced(self.transport.trace, stream, "reduce"):
            if self.world.device.type == "cuda":  # settings.sdma_reduce_ctas: 0 is the default
                kernel.launch_reduce(operands, out, also, n, dtype, stream,
                                     self.settings.sdma_reduce_ctas or None)
            else:
                kernel.reference_reduce_sum([host_array(a, n, dtype) for a in operands],
                                            host_array(out, n, dtype),
                                            None if also is None else host_array(also, n, dtype))
