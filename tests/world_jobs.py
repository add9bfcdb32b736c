"""Jobs run on every rank of a CPU world (module-level so the pool can pickle them).

Each rank builds its shard from a generator seeded by (seed, rank), so any rank can
rebuild every rank's inputs and compute the float64 reference independently.
"""

from __future__ import annotations

import torch

from radiance_ar import overlap
from radiance_ar.envs import BackendSettings
from radiance_ar.backends.interface import Backend, check_slice
from radiance_ar.buffers import refuse_growth_in_capture
from radiance_ar.transport.peer_memory import typed_view
from radiance_ar.transport.world import World
from radiance_ar.overlap.config import OverlapSettings


def shard(seed: int, rank: int, rows: int, cols: int, k: int,
          dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(cols, k, generator=g) / k ** 0.5).to(dtype)
    return x, w


def device_shards(seed: int, size: int, rows: int, cols: int, k: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``shard`` (activation, weight) on ``device``."""
    return [tuple(t.to(device) for t in shard(seed, r, rows, cols, k)) for r in range(size)]


def emulated_forward(ranks, rts: list, shards: list, timeout_ms: float) -> list[torch.Tensor]:
    """One op call per emulated rank (``radiance_ar.harness.emulated.EmulatedRanks``), each backend
    checked within ``timeout_ms``, the device synchronized; returns every rank's output."""
    outs = ranks.each(lambda r: overlap.forward(rts[r], *shards[r], None, "bf16"))
    for rt in rts:
        rt.backend.check(timeout_ms)
    torch.cuda.synchronize()
    return outs


def reference(seed: int, size: int, rows: int, cols: int, k: int, inputs=None) -> torch.Tensor:
    """float64 sum over ranks of x @ w.T, each rank's (x, w) from ``inputs(seed, rank, rows,
    cols, k)`` (default :func:`shard`)."""
    inputs = shard if inputs is None else inputs
    total = torch.zeros(rows, cols, dtype=torch.float64)
    for r in range(size):
        x, w = inputs(seed, r, rows, cols, k)
        total += x.double() @ w.double().t()
    return total


class PeerSumBackend(Backend):
    """Test-only reference AR: barrier, fp32 sum of every rank's peer-visible rows, barrier.

    Independent of every shipped backend; it exists to check the pipeline's slicing.
    """

    name = "test_peer_sum"
    uses_compute_units_while_waiting = True
    capture_safe = False
    bit_exact = True
    peer_visible_input = True

    def __init__(self, world: World, settings: BackendSettings | None = None):
        super().__init__(world, settings)
        self.buffer = None

    def ensure_capacity(self, max_rows, cols, dtype):
        nbytes = max_rows * cols * dtype.itemsize
        if self.buffer is None or self.buffer.nbytes < nbytes:
            refuse_growth_in_capture("test_peer_sum buffer", self.world.device)
            self.buffer = self.world.memory.allocate("test_peer_sum", nbytes)
        self.cols, self.dtype = cols, dtype

    def acquire_input_view(self, rows, cols, dtype):
        return typed_view(self.buffer.local, rows, cols, dtype)

    def all_reduce(self, slice_in, out):
        check_slice(slice_in, out)
        row_bytes = slice_in.shape[1] * slice_in.element_size()
        offset = slice_in.data_ptr() - self.buffer.local.data_ptr()
        self.world.memory.barrier()
        acc = torch.zeros(slice_in.shape, dtype=torch.float32, device=slice_in.device)
        for r in range(self.world.size):
            acc += typed_view(self.buffer.peer(r), slice_in.shape[0], slice_in.shape[1],
                              slice_in.dtype, offset).float()
        self.world.memory.barrier()
        assert offset % row_bytes == 0
        out.copy_(acc)

    def wire_bytes(self, numel, world_size, elem_size=2):
        return (world_size - 1) * numel * elem_size


def op_job(world: World, backend: str, rows: int, cols: int, k: int, slices: int,
           min_m: int, seed: int) -> dict:
    """One call of radiance::linear_ar (through the registered op) on this rank."""
    rt = overlap.configure(world, OverlapSettings(True, backend, min_m, slices))
    x, w = shard(seed, world.rank, rows, cols, k)
    out = torch.ops.radiance.linear_ar(x, w, None, "bf16")
    return {"out": out, "ref": reference(seed, world.size, rows, cols, k),
            "growths": rt.scratch.growths}


def pipeline_job(world: World, rows: int, cols: int, k: int, slices_list: list[int],
                 seed: int) -> dict:
    """The sliced pipeline with the test reference AR, for several slice counts."""
    results = {}
    backend = PeerSumBackend(world)
    for slices in slices_list:
        rt = overlap.OverlapRuntime(world, OverlapSettings(True, backend.name, 1, slices), backend)
        x, w = shard(seed, world.rank, rows, cols, k)
        results[slices] = overlap.forward(rt, x, w, None, "bf16")
    return {"outs": results, "ref": reference(seed, world.size, rows, cols, k)}


def waiting_backends() -> list[str]:
    """Registered backends whose waits carry their own spin bound (``waits_on_peers``:
    ``settings.spin_timeout_ms`` bounds them)."""
    from radiance_ar import backends

    return [n for n in backends.names() if backends.get(n).waits_on_peers]


def missing_peer_then_resync_job(world: World, backend: str, timeout_ms: float) -> dict:
    """Rank 0 calls all_reduce alone and must fail within the bound; then every rank
    resyncs and a full call must be right again (fresh inputs, poisoned output)."""
    import time

    import torch.distributed as dist

    from radiance_ar import backends
    from radiance_ar.transport.signals import PeerTimeoutError

    be = backends.get(backend)(world, BackendSettings(spin_timeout_ms=timeout_ms))
    rows, cols = 4, 256  # 256 columns: one block of the wht6 codec
    be.ensure_capacity(rows, cols, torch.bfloat16)
    res = {"elapsed": None, "message": None}
    try:
        if world.rank == 0:
            x = slice_input(1, 0, rows, cols)
            start = time.monotonic()
            try:
                be.all_reduce(x, torch.empty_like(x))
            except PeerTimeoutError as e:
                res["message"] = str(e)
            res["elapsed"] = time.monotonic() - start
        dist.barrier(group=world.group)
        be.resync()
        res["out"] = good_call(be, world, seed=2, rows=rows, cols=cols)
    finally:
        be.close()
    res["ref"], res["bound"] = inputs_sum(2, world.size, rows, cols), be.rel_rms_bound
    return res


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error of ``out`` (any device) against a float64 CPU reference (NaN
    stays NaN, so it fails every bound)."""
    return float((out.double().cpu() - ref).norm() / ref.norm())


def run_where_served(pool, job, backend: str, *args) -> list:
    """``pool.run(job, backend, *args)``; skips the test with the gate's reason when the
    job reports that ``backend`` cannot serve the pool's world."""
    import pytest

    res = pool.run(job, backend, *args)
    if "skipped" in res[0]:
        pytest.skip(f"{backend}: {res[0]['skipped']}")
    return res


def assert_right_on_every_rank(res: list[dict]) -> None:
    """Each rank's ``out`` within its ``bound`` of ``ref`` and the same bits as rank 0's."""
    for rank, r in enumerate(res):
        assert rel_rms(r["out"], r["ref"]) <= r["bound"], rank
        assert torch.equal(r["out"], res[0]["out"]), rank


def slice_input(seed: int, rank: int, rows: int, cols: int) -> torch.Tensor:
    """An all_reduce input of ``rank``: the ``x`` of a ``shard`` with K = cols."""
    return shard(seed, rank, rows, 1, cols)[0]


def inputs_sum(seed: int, size: int, rows: int, cols: int) -> torch.Tensor:
    """float64 sum over ranks of ``slice_input`` (the all_reduce jobs' reference)."""
    return sum(slice_input(seed, r, rows, cols).double() for r in range(size))


def good_call(be: Backend, world: World, seed: int, rows: int, cols: int) -> torch.Tensor:
    x = slice_input(seed, world.rank, rows, cols)
    out = torch.full_like(x, float("nan"))
    be.all_reduce(x, out)
    return out


#: (label, (slice_in, out) from a good pair, error type, words the message must hold)
BAD_SLICES = [
    ("int32 input", lambda x, o: (x.to(torch.int32), o), TypeError, "dtype"),
    ("1-D input", lambda x, o: (x.reshape(-1), o), ValueError, "2-D"),
    ("3-D input", lambda x, o: (x.unsqueeze(0), o), ValueError, "2-D"),
    ("non-contiguous input", lambda x, o: (x.t().contiguous().t(), o.t().contiguous().t()),
     ValueError, "contiguous"),
    ("out of another shape", lambda x, o: (x, o[:-1]), ValueError, "must match"),
    ("out of another dtype", lambda x, o: (x, o.to(torch.float32)), ValueError, "must match"),
    ("out on another device", lambda x, o: (x, o.to("meta")), ValueError, "but out on meta"),
]


def bad_slices_job(world: World, backend: str) -> dict:
    """Every rank makes each bad call of ``BAD_SLICES`` (and, for a backend with buffers,
    one over its capacity): each must raise its own error (also once an earlier one
    faulted the rank), leave the poisoned ``out`` and the input untouched, and move
    neither the call numbering nor a step's flag (every rank making the same bad calls
    would stay in step even if one did, so that is checked directly). A refused call faults the rank (Backend.checking_call:
    a peer that made it hears of it), so after a resync a good call must be right."""
    from radiance_ar import backends

    reason = backends.get(backend).unsupported_reason(world)
    if reason is not None:
        return {"skipped": reason}
    be = backends.get(backend)(world)
    rows, cols = 4, 256
    be.ensure_capacity(rows, cols, torch.bfloat16)
    x = slice_input(3, world.rank, rows, cols)
    cases = list(BAD_SLICES)
    if type(be).ensure_capacity is not Backend.ensure_capacity:
        big = slice_input(4, world.rank, 64 * rows, cols)
        cases.append(("rows over capacity", lambda x, o: (big, torch.full_like(big, float("nan"))),
                      ValueError, "ensure_capacity"))

    def protocol():
        from radiance_ar.transport.signals import SLOTS

        sig = getattr(be, "signals", None)
        return None if sig is None else (sig.epoch, [sig.peer_value(p, s) for p in
                                                     range(world.size) for s in SLOTS])

    errors = {}
    for label, make, error, words in cases:
        before_protocol = protocol()
        out = torch.full_like(x, float("nan"))
        bad_in, bad_out = make(x.clone(), out)
        before = bad_in.clone() if bad_in.device.type != "meta" else None
        try:
            be.all_reduce(bad_in, bad_out)
            errors[label] = "no error"
        except (TypeError, ValueError) as e:
            errors[label] = (type(e) is error and words in str(e)) or f"{type(e).__name__}: {e}"
        untouched = bool(out.isnan().all()) and (before is None or torch.equal(before, bad_in))
        if bad_out.device.type != "meta" and bad_out.data_ptr() != out.data_ptr():
            untouched &= bool(bad_out.isnan().all())
        if not untouched:
            errors[label] = "wrote into out or its input"
        if protocol() != before_protocol:
            errors[label] = f"moved the epoch or a flag: {before_protocol} -> {protocol()}"
    world.memory.barrier()  # no rank's good call below may post while a peer still checks
    be.resync()
    res = {"errors": errors, "out": good_call(be, world, seed=5, rows=rows, cols=cols),
           "ref": inputs_sum(5, world.size, rows, cols), "bound": be.rel_rms_bound}
    be.close()
    return res


STREAM_APIS = ("Stream", "Event", "ExternalStream")


def decode_path_job(world: World, backend: str, min_m: int = 64) -> dict:
    """The op below MIN_M with ``backend`` selected: results, whether it grew any buffer
    (scratch, peer-visible memory) or made its lanes (streams and events: on a CPU world
    ``Lanes`` makes none even when made, so the lanes check is the one that bites here),
    and whether it called one of ``STREAM_APIS`` (replaced by recorders meanwhile)."""
    from radiance_ar import backends

    reason = backends.get(backend).unsupported_reason(world)
    if reason is not None:
        return {"skipped": reason}
    made: list[str] = []
    saved = {name: getattr(torch.cuda, name) for name in STREAM_APIS}
    rt = overlap.build(world, OverlapSettings(True, backend, min_m, 4))
    peer = (world.memory.allocations, world.memory.allocated_bytes)
    outs = {}
    try:
        for name in STREAM_APIS:
            setattr(torch.cuda, name, lambda *a, _name=name, **k: made.append(_name))
        for rows in (1, 7, min_m - 1):
            x, w = shard(6, world.rank, rows, 256, 32)
            outs[rows] = overlap.forward(rt, x, w, None, "bf16")
    finally:
        for name, api in saved.items():  # the pool's processes run later jobs too
            setattr(torch.cuda, name, api)
    grew = ((world.memory.allocations, world.memory.allocated_bytes) != peer
            or rt.scratch.growths > 0 or rt._lanes is not None)
    rt.close()
    return {"outs": outs, "refs": {rows: reference(6, world.size, rows, 256, 32) for rows in outs},
            "made": made, "grew": grew}
