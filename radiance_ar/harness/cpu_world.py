"""A world of W real processes on this machine (a gloo group), started once, reused many times.

CPU ranks (gloo + shared memory: cpu-shm) by default; with ``device="cuda:0"`` every rank
drives that GPU from its own process (``"cuda"``: rank r drives GPU r modulo the GPUs
visible), its peer memory chosen by ``peer_memory``
(:func:`radiance_ar.transport.world.from_process_group`: ``host`` gives the gpu-host world,
the only one whose ranks may share a GPU). Starting a process costs seconds here, so tests
and tools start one pool and send it many jobs::

    with CpuWorldPool(4) as pool:
        results = pool.run(my_job, 8192)   # my_job(world, 8192) on every rank

``my_job`` must be a module-level function (it is pickled by reference). A job that
raises on any rank raises :class:`WorldError` here with that rank's traceback; a rank
that dies, or a job that outlives ``timeout_s``, also raises (and the pool is closed,
since its other ranks may be stuck in a collective).
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from radiance_ar.transport.peer_memory import SHM_ROOT


class WorldError(RuntimeError):
    """A job failed, a rank died, or a job timed out in a :class:`CpuWorldPool`."""


def _worker(rank: int, size: int, init_file: str, shm_root: str, jobs, results,
            collective_timeout_s: float, threads: int, device: str,
            peer_memory: str | None) -> None:
    import torch.distributed as dist

    from radiance_ar.transport import peer_memory as shared_files
    from radiance_ar.transport.world import from_process_group

    shared_files.SHM_ROOT = shm_root  # every job directory of this pool's worlds goes here

    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:  # "cuda": a GPU per rank where there are enough, else shared
            dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=collective_timeout_s))
    world = from_process_group(device=dev, peer_memory=peer_memory)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, True, fn(world, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 -- the traceback travels to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class CpuWorldPool:
    """W gloo processes on this machine; see the module docstring."""

    def __init__(self, size: int, collective_timeout_s: float = 60.0, device: str = "cpu",
                 peer_memory: str | None = None):
        """``device``: every rank's device (``cpu``, one GPU all ranks share, or ``cuda``);
        ``peer_memory``: the GPU ranks' (``from_process_group``; None: the environment's)."""
        if size < 1:
            raise ValueError(f"CpuWorldPool: size must be >= 1, got {size}")
        self.size, self.device = size, device
        # How long a rank may take to leave before it is killed: a GPU process tears down its
        # context too, and a rank 0 killed here would leave the job's memory directory.
        self.close_timeout_s = 5.0 if device == "cpu" else 30.0
        self._procs: list = []
        self._jobs: list = []
        # Whoever can read or write the rendezvous file can watch or disturb the world, and
        # the FileStore would create it readable by everyone (0644): it is made here, 0600,
        # in a directory of our own (0700, random name). The finalizer removes that
        # directory on every path: close(), a failed start, or a pool never closed.
        self._init_dir = tempfile.mkdtemp(prefix="radiance-ar-init-")
        self._remove_init_dir = weakref.finalize(self, shutil.rmtree, self._init_dir,
                                                 ignore_errors=True)
        self._init_file = os.path.join(self._init_dir, "store")
        #: the shared-memory job directories of this pool's worlds are made in here (0700,
        #: random name), removed with the ranks gone: a rank 0 killed outright (a job past
        #: its time, a pool never closed) leaves nothing behind either
        self.shm_root: str | None = None
        self._remove_shm_root = None
        try:
            self.shm_root = tempfile.mkdtemp(prefix="radiance-ar-pool-", dir=SHM_ROOT)
            self._remove_shm_root = weakref.finalize(self, shutil.rmtree, self.shm_root,
                                                     ignore_errors=True)
            os.close(os.open(self._init_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            ctx = mp.get_context("spawn")
            self._results = ctx.Queue()
            self._jobs = [ctx.Queue() for _ in range(size)]
            threads = max(1, (os.cpu_count() or 1) // size)
            for r in range(size):
                self._procs.append(ctx.Process(
                    target=_worker, daemon=True,
                    args=(r, size, self._init_file, self.shm_root, self._jobs[r],
                          self._results, collective_timeout_s, threads, device,
                          peer_memory)))
                self._procs[-1].start()
        except BaseException:
            self.close()
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0,
            dying: tuple[int, ...] = (), **kwargs: Any) -> list[Any]:
        """Run ``fn(world, *args, **kwargs)`` on every rank; results indexed by rank.
        ``dying``: ranks the job kills on purpose (a killed peer); their result is None,
        the others' are awaited, and the pool is closed afterwards (the world is broken)."""
        if not self._procs:
            raise WorldError("CpuWorldPool is closed")
        for q in self._jobs:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {r: None for r in dying}
        failures: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(out) + len(failures) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs)
                        if p.exitcode is not None and r not in dying]
                if dead:
                    codes = [self._procs[r].exitcode for r in dead]
                    self.close()
                    raise WorldError(f"{fn.__name__}: rank(s) {dead} died (exit codes {codes}); "
                                     "pool closed")
                if time.monotonic() > deadline:
                    self.close()
                    raise WorldError(f"{fn.__name__}: no result from every rank within "
                                     f"{timeout_s:g} s; pool closed")
                continue
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if dying:
            self.close()
        if failures:
            raise WorldError(f"{fn.__name__} failed on {len(failures)} rank(s):\n"
                             + "\n".join(failures))
        return [out[r] for r in range(self.size)]

    @property
    def closed(self) -> bool:
        return not self._procs

    def close(self) -> None:
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            if p.pid is None:  # never started (a failed start)
                continue
            p.join(timeout=self.close_timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        self._remove_init_dir()
        if self._remove_shm_root is not None:
            self._remove_shm_root()

    def __enter__(self) -> "CpuWorldPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
