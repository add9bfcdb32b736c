"""``sdma``: all-reduce by DMA copies (no compute units while waiting) + one local reduce.

Each rank's slice sits in its peer-visible buffer ``pub`` (the GEMM writes there through
``acquire_input_view``); peers PULL it with copy-engine copies (:mod:`backends.copy_engine`)
after a stream wait-value on its ``ready`` flag (:mod:`backends.signals`), then one
short reduce kernel sums in rank order 0..W-1 with fp32 accumulation, rounded once
(:mod:`backends.kernels.reduce_sum`): bit-exact and identical on every rank.

Schedules (``settings.sdma_schedule``, from ``RADIANCE_AR_SDMA_SCHEDULE``, or the
``schedule`` argument, which fixes one): one-shot, two-shot or auto, as
:mod:`backends.sdma_schedule` defines them.

One call of rank r (epoch t; every rank numbers calls alike), on the caller's stream
(in the emulated world the publishes run beside it: :mod:`backends.publish_lane`)::

  rank r stream : [fence] publish ready_r=t  wait ready_p>=t  pull p   done_r=t  reduce
  rank p stream :         publish ready_p=t  wait ready_r>=t  pull r   done_p=t  reduce
                                    |________________________^
Buffer reuse (why ``done`` exists). Rank r's NEXT write into the rows of ``pub`` that a
peer may still be pulling (its next GEMM into ``acquire_input_view``, or the next publish /
staging copy of an overlapping row range) must wait until that peer finished::

  rank r : AR(t) ready_r=t ... done_r=t | acquire_input_view: wait done_p>=t | GEMM(t+1) writes pub
  rank p :    wait ready_r>=t  pull r(t) ---------------> done_p=t  |
                                 ^ a GEMM(t+1) here without the wait would corrupt p's pull

The fence is a stream wait-value (no host sync); rows of one op call's slices are
disjoint, so the fence runs once per op call (in ``acquire_input_view``) or where a direct
``all_reduce`` reuses rows (byte ranges are tracked per epoch). Two-shot's ``red`` buffer
mirrors ``pub``'s layout, and ``done`` is posted after the last pull of either, so the
same fence covers it. The receive buffers are private and stream-ordered.

Worlds (docs/design.md, 'Worlds'): ``cpu-shm`` (host copies and spins), ``gpu-symm``
(buffers and flags in symmetric memory), ``gpu-emulated`` (W ranks on one GPU, buffers
and flags in pinned host memory: the GEMM writes a private device buffer, the publish is
a D2H copy and pulls are H2D copies, so every cross-rank byte crosses the host link).
Emulated ranks are driven from one host thread, so a rank's stream may block on a flag
that a LATER host call of a peer posts, and any implicit device synchronization in
between (a first kernel load, a cudaFree) deadlocks: ``ensure_capacity`` loads the
reduce kernels and must run on every rank before the first ``all_reduce``.

``capture_safe = False``: epochs are host integers passed by value into the wait/write
operations, so a captured graph would replay stale epochs.
"""

from __future__ import annotations

import torch

from backends.copy_engine import CopyEngine, bindings_reason, platform
from backends.envs import BackendSettings
from backends import passive_peers
from backends.interface import (Backend, check_capacity_args, check_slice, copy_unless_same,
                                current_stream_handle, grown_size, refuse_growth_in_capture)
from backends.peer_memory import typed_view
from backends.publish_lane import PublishLane
from backends.registry import register
from backends.sdma_schedule import COMPUTE_UNITS, auto_schedule, schedule_wire_bytes, shard_bounds
from backends.gpu_signals import GpuSignals
from backends.signals import FLAG_BYTES, CpuSignals, Signals
from backends.trace import StepTrace, traced
from backends.world import KINDS, MAX_WORLD, World

MAX_PENDING = 64  # reuse-fence entries kept before the oldest is waited for


@register("sdma")
class SdmaBackend(Backend):
    # Class defaults; each instance refines uses_compute_units_while_waiting for its path
    # (see sdma_schedule.COMPUTE_UNITS and ``compute_unit_note``).
    uses_compute_units_while_waiting = False
    capture_safe = False
    bit_exact = True
    # One rounding of the fp32 sum: relative error <= 2^-8 (bf16 unit roundoff) per element.
    rel_rms_bound = 2.0 ** -8
    peer_visible_input = True
    waits_on_peers = True

    def __init__(self, world: World, settings: BackendSettings | None = None, *,
                 schedule: str | None = None):
        """``settings``: ``sdma_schedule`` and ``spin_timeout_ms`` (default: the
        environment's). ``schedule`` fixes the schedule whatever the settings say
        (``sdma_wht6``: one-shot only; a probe of one schedule); checked alike."""
        super().__init__(world, settings)
        if schedule is not None:
            self.settings = self.settings.replace(sdma_schedule=schedule)
        self.schedule = self.settings.sdma_schedule
        timeout = self.settings.spin_timeout_ms
        self.platform = platform(world.device)
        self.uses_compute_units_while_waiting, self.compute_unit_note = COMPUTE_UNITS[
            (world.kind, self.platform)]
        self.emulated = world.kind == "gpu-emulated"
        self.engine = CopyEngine(world.device) if world.size > 1 else None
        #: emulated world: publishes (D2H) on their own stream, beside the pulls (H2D)
        self._lane = PublishLane(world.device) if self.emulated and world.size > 1 else None
        self.signals: Signals | None = None
        if world.size > 1:
            flags = world.memory.allocate("sdma.flags", FLAG_BYTES)
            self.signals = (CpuSignals(flags, world.rank, world.size, timeout, self.name)
                            if self.platform == "cpu" else
                            GpuSignals(flags, world.rank, world.size, timeout, self.engine,
                                       self.name))
        self.capacity = 0  # bytes of one slice buffer
        self._pub = self._red = None
        self._stage: torch.Tensor | None = None  # emulated: the GEMM's device buffer
        self._recv: torch.Tensor | None = None  # W-1 private receive buffers
        self._pending: list[tuple[int, int, int]] = []  # (epoch, lo, hi) peers may still read
        self._warm: set[torch.dtype] = set()  # dtypes whose reduce kernels are loaded
        #: bytes this rank pulled from peers' buffers, cumulative (tests compare wire_bytes)
        self.pulled_bytes = 0
        #: events around each step of a call (GPU; tools/timeline.py sets it for one call)
        self.trace: StepTrace | None = None

    @classmethod
    def unsupported_reason(cls, world: World) -> str | None:
        kind = world.kind
        if kind not in KINDS:
            return f"world kind {kind!r} is unknown to sdma (known: {', '.join(KINDS)})"
        if world.size > MAX_WORLD:
            return f"world size {world.size} > {MAX_WORLD}, the reduce kernel's input limit"
        dev = torch.device(world.device)
        if kind == "cpu-shm" and dev.type != "cpu":
            return f"a cpu-shm world on device {dev}"
        if kind.startswith("gpu") and dev.type != "cuda":
            return f"a {kind} world needs a CUDA/ROCm device, got {dev}"
        if dev.type == "cuda" and world.size > 1:
            if not torch.cuda.is_available():
                return "no CUDA/ROCm device is visible"
            return bindings_reason(dev)
        return None

    # ------------------------------------------------------------------ contract

    def schedule_for(self, nbytes: int) -> str:
        return (auto_schedule(nbytes, self.world.size) if self.schedule == "auto"
                else self.schedule)

    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        return schedule_wire_bytes(self.schedule, numel * elem_size, world_size)

    def ensure_capacity(self, max_rows: int, cols: int, dtype: torch.dtype) -> None:
        check_capacity_args("sdma", max_rows, cols, dtype)
        need = max_rows * cols * dtype.itemsize
        if dtype not in self._warm and self.world.size > 1 and self.world.device.type == "cuda":
            from backends.kernels import reduce_sum as kernel

            refuse_growth_in_capture("sdma reduce kernel warm-up", self.world.device)
            kernel.warm_up(self.world.size, dtype, self.world.device,
                           with_also=self.world.kind == "gpu-symm")
            self._warm.add(dtype)
        if need <= self.capacity:
            return
        refuse_growth_in_capture(f"sdma buffers ({need} B per slice buffer)", self.world.device)
        self._quiesce()
        # Whole 256-byte units keep every receive slot aligned for 16-byte vector loads.
        nbytes = grown_size(need, self.capacity, 256)
        self.close()  # a growth that fails below leaves no buffers and capacity 0
        mem, dev, size = self.world.memory, self.world.device, self.world.size
        self._pub = mem.allocate("sdma.pub", nbytes)
        if size > 1 and self.schedule in ("auto", "twoshot"):
            self._red = mem.allocate("sdma.red", nbytes)
        if self.emulated:
            self._stage = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        if size > 1:
            self._recv = torch.empty((size - 1) * nbytes, dtype=torch.uint8, device=dev)
        self.capacity = nbytes

    def acquire_input_view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        need = rows * cols * dtype.itemsize
        if need > self.capacity:
            raise ValueError(f"sdma.acquire_input_view: {rows}x{cols} {dtype} needs {need} B, capacity "
                             f"is {self.capacity} B: call ensure_capacity first")
        if self.signals is not None:
            self.signals.faults.refuse_if_faulted()
            try:
                stream = current_stream_handle(self.world.device)
                with traced(self.trace, stream, "fence"):
                    self._fence(0, self.capacity, stream)
            except BaseException as e:
                self.signals.fail(e)
                raise
        return typed_view(self._input_base(), rows, cols, dtype)

    def all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor) -> None:
        check_slice(slice_in, out)
        if self.world.size == 1:
            copy_unless_same(slice_in, out)
            return
        nbytes = self._check_fits(slice_in.numel() * slice_in.element_size())
        stream = current_stream_handle(self.world.device)
        with self.signals.call(self.signature(slice_in)) as t:
            off, local = self._publish(t, slice_in, stream)
            if self.schedule_for(nbytes) == "oneshot":
                ops = self._pull_all(t, off, nbytes, stream)
                self._reduce([local if q == self.world.rank else ops[q].view(out.dtype)
                              for q in range(self.world.size)], out.view(-1), stream)
            else:
                self._twoshot(t, off, local, out, stream)
            self._finish(t, off, nbytes, stream)

    def check(self, timeout_ms: float | None = None) -> None:
        """Host-side bounded wait for every call enqueued so far (GPU); raises naming a
        missing peer (:meth:`backends.gpu_signals.GpuSignals.check`). CPU: waits are inline."""
        if self.signals is not None:
            self.signals.check(timeout_ms)

    def resync(self) -> None:
        """Collective (:meth:`Backend.resync`). Emulated world: call :meth:`check` on EVERY
        rank first (it releases a stream blocked on a missing peer; the device sync here
        waits for every rank's streams). Refused in gpu-symm, on every rank: device-memory
        flags cannot be released, and the sync would wait forever for a missing peer."""
        if self.signals is None:
            return
        if self.world.kind == "gpu-symm":
            raise RuntimeError(
                f"{self.name}.resync: not possible in a gpu-symm world: a stream waiting on a "
                "peer's device-memory flag cannot be released; if the peer never comes, "
                "restart the job (a late peer completes the call, leaving the ranks in step)")
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        self.signals.resync(self.world.memory.barrier)
        self._pending.clear()  # every peer read before the jump is over (no call in flight)

    def close(self) -> None:
        self._pub = self._red = self._stage = self._recv = None
        self.capacity = 0

    def start_trace(self) -> StepTrace | None:
        if self.world.device.type != "cuda" or self.world.size == 1:
            return None
        lanes = {current_stream_handle(self.world.device): "AR steps (caller stream)"}
        if self._lane is not None:
            lanes[self._lane.handle] = "publish lane"
        self.trace = StepTrace(self.world.device, lanes)
        return self.trace

    def stop_trace(self) -> None:
        self.trace = None

    # ------------------------------------------------------------------ timing helpers

    def exchange_only(self, slice_in: torch.Tensor) -> list[torch.Tensor]:
        """The transport half of a one-shot call, no reduce: publish, flags, W-1 pulls.

        Returns the received peer slices (uint8, rank order, own slot empty). Used by
        :mod:`diagnostics.cu_free_check` to prove the transport progresses with every SM held.
        """
        if self.world.size == 1:
            return []
        nbytes = self._check_fits(slice_in.numel() * slice_in.element_size())
        stream = current_stream_handle(self.world.device)
        with self.signals.call(self.signature(slice_in)) as t:
            off, _ = self._publish(t, slice_in, stream)
            ops = self._pull_all(t, off, nbytes, stream)
            self._finish(t, off, nbytes, stream)
        return [ops.get(q, slice_in.new_empty(0, dtype=torch.uint8))
                for q in range(self.world.size)]

    def fill_passive_peers(self, payload: torch.Tensor | None = None, seed: int = 0) -> None:
        """Timing mode: make every OTHER rank a passive peer that never calls.

        Fills each peer's ``pub`` (and ``red``) with ``payload``'s bytes (repeated), or
        with normal bf16 values from ``seed`` (never zeros: they can time faster), and
        raises its flags to :data:`backends.signals.PASSIVE_EPOCH`, so this rank's waits
        pass at once and its pulls move real bytes. Results are then NOT sums over ranks.
        Host writes: call after :meth:`ensure_capacity`, before timing, with no call in flight.
        """
        if self.capacity == 0:
            raise ValueError("sdma.fill_passive_peers: call ensure_capacity first")
        if payload is None:
            g = torch.Generator().manual_seed(seed)
            payload = torch.randn(self.capacity // 2, generator=g).to(torch.bfloat16)
        fill = passive_peers.repeated_bytes(payload, self.capacity)
        for buf in (self._pub, self._red):
            if buf is not None:
                passive_peers.fill_other_ranks(buf, self.world.rank, fill)
        for p in range(self.world.size):
            if p != self.world.rank:
                self.signals.set_passive(p)

    # ------------------------------------------------------------------ internals

    def _input_base(self) -> torch.Tensor:
        return self._stage if self.emulated else self._pub.local

    def _peer_order(self) -> list[int]:
        # Start with the next rank so that the W ranks do not all pull from rank 0 first.
        r, w = self.world.rank, self.world.size
        return [(r + k) % w for k in range(1, w)]

    def _check_fits(self, nbytes: int) -> int:
        if nbytes > self.capacity:
            raise ValueError(f"{self.name}.all_reduce: a slice of {nbytes} B exceeds the "
                             f"capacity of {self.capacity} B: call ensure_capacity first")
        return nbytes

    def _publish(self, t: int, slice_in: torch.Tensor, stream: int) -> tuple[int, torch.Tensor]:
        """Byte offset of call ``t``'s slice in ``pub``, and the local operand (flat, typed)."""
        nbytes = slice_in.numel() * slice_in.element_size()
        base = self._input_base()
        off = slice_in.data_ptr() - base.data_ptr()
        inside = slice_in.device == base.device and 0 <= off and off + nbytes <= self.capacity
        if inside and off % slice_in.element_size():
            raise ValueError("sdma.all_reduce: slice_in is misaligned inside the input buffer")
        off = off if inside else 0  # outside: staged at offset 0 (every rank alike)
        copy = not inside or self.emulated  # a staging copy / the emulated D2H publish
        self._post_publish(t, "ready", self._pub.local[off:off + nbytes] if copy else None,
                           slice_in, stream, fence=(off, off + nbytes))
        return off, slice_in.reshape(-1)

    def _post_publish(self, t: int, slot: str, dst: torch.Tensor | None, src: torch.Tensor,
                      stream: int, fence: tuple[int, int] | None = None) -> None:
        """Copy ``src`` into my peer-visible ``dst`` (None: already there) and post ``slot``
        of call ``t``, after the reuse ``fence`` of those bytes: on the publish lane where
        there is one (:mod:`backends.publish_lane`), else on ``stream``."""
        def publish(on: int) -> None:
            if fence is not None:
                self._fence(*fence, on)
            with traced(self.trace, on, "publish" if slot == "ready" else "publish reduced"):
                if dst is not None:
                    self.engine.copy(dst, src, on)
                self.signals.post(slot, t, on)

        if self._lane is None:
            publish(stream)
            return
        with self._lane.publishing(0 if slot == "ready" else 1) as lane:
            publish(lane)

    def _wait_pull(self, peer: int, slot: str, t: int, dst: torch.Tensor, src: torch.Tensor,
                   stream: int, what: str) -> None:
        """Wait for ``peer``'s ``slot`` flag of call ``t``, then copy ``src`` (its memory)
        into ``dst``: one step of every pull phase."""
        with traced(self.trace, stream, "wait", slot, peer):
            self.signals.wait(peer, slot, t, stream, what)
        with traced(self.trace, stream, "pull reduced" if slot == "reduced" else "pull", peer):
            self.pulled_bytes += self.engine.copy(dst, src, stream)

    def _recv_slot(self, peer: int, nbytes: int) -> torch.Tensor:
        k = (peer - self.world.rank - 1) % self.world.size  # 0..W-2
        return self._recv[k * self.capacity:k * self.capacity + nbytes]

    def _pull_all(self, t: int, off: int, nbytes: int, stream: int) -> dict[int, torch.Tensor]:
        got = {}
        for p in self._peer_order():
            got[p] = self._recv_slot(p, nbytes)
            self._wait_pull(p, "ready", t, got[p], self._pub.peer(p)[off:off + nbytes], stream,
                            f"{self.name} one-shot all_reduce")
        self.signals.post("done", t, stream)
        return got

    def _twoshot(self, t: int, off: int, local: torch.Tensor, out: torch.Tensor,
                 stream: int) -> None:
        r, e = self.world.rank, out.element_size()
        bounds = shard_bounds(out.numel(), self.world.size, e)
        lo, hi = bounds[r], bounds[r + 1]
        what = f"{self.name} two-shot all_reduce"
        ops = {}
        for p in self._peer_order():
            ops[p] = self._recv_slot(p, (hi - lo) * e)
            self._wait_pull(p, "ready", t, ops[p], self._pub.peer(p)[off + lo * e:off + hi * e],
                            stream, what)
        flat = out.view(-1)
        mine = self._red.local[off + lo * e:off + hi * e].view(out.dtype)
        operands = [local[lo:hi] if q == r else ops[q].view(out.dtype)
                    for q in range(self.world.size)]
        if self.world.kind == "gpu-symm":
            # red is this GPU's memory: the kernel writes it too (no same-device D2D copy).
            self._reduce(operands, flat[lo:hi], stream, also=mine)
            self.signals.post("reduced", t, stream)
        else:
            self._reduce(operands, flat[lo:hi], stream)
            # host copy / emulated D2H publish (peers' shards land in flat[a:b], disjoint)
            self._post_publish(t, "reduced", mine, flat[lo:hi], stream)
        for p in self._peer_order():
            a, b = bounds[p], bounds[p + 1]
            self._wait_pull(p, "reduced", t, flat[a:b], self._red.peer(p)[off + a * e:off + b * e],
                            stream, what)
        self.signals.post("done", t, stream)

    def _reduce(self, operands: list[torch.Tensor], out: torch.Tensor, stream: int,
                also: torch.Tensor | None = None) -> None:
        """Sum ``operands`` into ``out`` (and ``also``) on ``stream``, the current stream."""
        if out.numel() == 0:
            return
        from backends.kernels import reduce_sum as kernel

        with traced(self.trace, stream, "reduce"):
            (kernel.reduce_sum if out.is_cuda else kernel.reference_reduce_sum)(operands, out,
                                                                               also)

    def _fence(self, lo: int, hi: int, stream: int) -> None:
        """Order ``stream`` after every peer read of bytes [lo, hi) still in flight."""
        if self.signals is None:
            return
        hits = [ep for ep, a, b in self._pending if a < hi and lo < b]
        if len(self._pending) > MAX_PENDING:
            hits.append(self._pending[-1][0])
        if not hits:
            return
        epoch = max(hits)
        for p in self._peer_order():
            self.signals.wait(p, "done", epoch, stream, "the reuse fence (peer still reading)")
        self._pending = [x for x in self._pending if x[0] > epoch]

    def _finish(self, t: int, off: int, nbytes: int, stream: int) -> None:
        self._pending.append((t, off, off + nbytes))
        if self._lane is not None:
            self._lane.join()
        self.signals.end_call(stream)

    def _quiesce(self) -> None:
        """Before buffers are replaced: every peer read done, every enqueued call finished."""
        if self.signals is None or not self._pending:
            return
        self._fence(0, self.capacity, current_stream_handle(self.world.device))
        self.check()
