"""Peer-visible buffers: memory each rank writes and every other rank can read.

One implementation per kind of world (docs/design.md, 'Worlds'), plus :class:`LocalMemory` for a
world of one rank:

- :class:`SharedFileMemory`: CPU ranks in separate processes; one file per rank and
  allocation, mapped by every rank (the CI test bed). The files are private: random
  names in a per-job directory of mode 0700 under ``/dev/shm``, created exclusively with
  mode 0600, checked before a peer maps them, unlinked once mapped.
- :class:`SymmetricMemory`: one GPU per process; ``torch.distributed._symmetric_memory``
  (CUDA, and ROCm since torch 2.8 through HIP VMM).
- :class:`PinnedHostMemory`: W emulated ranks in one process on one GPU; every rank's
  buffer in pinned host memory, so each cross-rank byte crosses the host link (PCIe),
  as on a PCIe multi-GPU box.

``allocate`` and ``barrier`` are collective: every rank calls them in the same order.
A :class:`PeerBuffer` is raw bytes; :func:`typed_view` gives a typed 2-D view.
"""

from __future__ import annotations

import abc
import contextlib
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from radiance_ar.transport.watchdog import run_at_stop


@dataclass
class PeerBuffer:
    name: str
    nbytes: int
    rank: int
    peers: list[torch.Tensor]  # uint8 [nbytes] of every rank, this rank's included
    _keepalive: list = field(default_factory=list, repr=False)

    @property
    def local(self) -> torch.Tensor:
        return self.peers[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        return self.peers[rank]


def typed_view(raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype,
               byte_offset: int = 0) -> torch.Tensor:
    """A ``rows x cols`` view of ``dtype`` into the uint8 tensor ``raw`` at ``byte_offset``."""
    size = dtype.itemsize
    nbytes = rows * cols * size
    assert byte_offset % size == 0 and byte_offset + nbytes <= raw.numel(), (
        f"view of {nbytes} B at {byte_offset} exceeds buffer of {raw.numel()} B")
    return raw[byte_offset:byte_offset + nbytes].view(dtype).view(rows, cols)


class PeerMemory(abc.ABC):
    """Allocates :class:`PeerBuffer` s for one rank of a world."""

    kind: str

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        #: allocations made and bytes allocated by this rank (flat after warm-up)
        self.allocations = 0
        self.allocated_bytes = 0

    def allocate(self, name: str, nbytes: int) -> PeerBuffer:
        """Collective: a fresh zero-filled buffer of ``nbytes`` on every rank."""
        if nbytes < 1:
            raise ValueError(f"peer buffer {name!r}: nbytes must be >= 1, got {nbytes}")
        self.allocations += 1
        self.allocated_bytes += nbytes
        return self._allocate(name, nbytes)

    @abc.abstractmethod
    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        """The implementation's allocation (see :meth:`allocate`)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective host barrier."""

    def close(self) -> None:
        """Release what outlives the buffers (files, directories); buffers stay valid."""
        return None

    def dead_peers(self) -> list[int]:
        """The ranks whose process has exited, where this world can know it (processes of
        one host); else none. A diagnosis names them before any peer that waits on them."""
        return []


#: where rank 0 makes its job directory when no root is given. A CpuWorldPool's workers
#: set their pool's own directory here, which the pool removes after its ranks are gone,
#: with whatever a rank 0 killed outright left behind (radiance_ar/harness/cpu_world.py)
SHM_ROOT = "/dev/shm"


class SharedFileMemory(PeerMemory):
    """CPU processes of one gloo group; buffers are ``/dev/shm`` files mapped by all ranks.

    Privacy: rank 0 makes one directory per job with :func:`tempfile.mkdtemp` (random
    name, mode 0700) and every other rank checks that it is ours and 0700 before using
    it. Each allocation creates one file per rank with a random name, exclusively
    (``O_EXCL``) and mode 0600; a peer's file is mapped only after checking that it is a
    regular file of ours, mode 0600, of the expected size. So another local user can
    neither predict a name nor slip in a file of their own.

    Each rank unlinks its file once every rank has mapped it, or when the allocation
    fails (a peer gone, a collective timed out). Rank 0 removes the directory, with
    anything a killed rank left in it, at :meth:`close`, on garbage collection or at
    interpreter exit, or when its watchdog stops it (radiance_ar/transport/watchdog.py);
    only a rank 0 killed outright leaves it behind (still mode 0700), and in a
    :class:`~radiance_ar.harness.cpu_world.CpuWorldPool` not even that.
    """

    kind = "cpu-shm"

    def __init__(self, group: dist.ProcessGroup | None, root: str | None = None):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        root = SHM_ROOT if root is None else root
        self.group = group
        self._finalizer = None
        shared: list = [None, None]  # the directory, or why rank 0 could not make it
        if self.rank == 0:
            try:
                shared[0] = tempfile.mkdtemp(prefix="radiance-ar-", dir=root)
                # Only the creator removes it; a finalizer (unlike __del__) also runs at exit.
                self._finalizer = weakref.finalize(self, shutil.rmtree, shared[0],
                                                   ignore_errors=True)
                run_at_stop(self._finalizer)  # a watchdog's stop removes it too
                os.chmod(shared[0], 0o700)  # exactly 0700 whatever the umask: peers check it
            except Exception as e:  # noqa: BLE001 -- the peers wait in the broadcast
                shared[1] = f"{type(e).__name__}: {e}"
                failure = e
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)
        if shared[1] is not None:
            self.close()
            if self.rank == 0:
                raise failure
            raise RuntimeError(f"SharedFileMemory: rank 0 could not make the job directory "
                               f"under {root}: {shared[1]}")
        self._dir: str | None = shared[0]
        error = None
        if self.rank != 0:
            try:
                _check_private_dir(self._dir)
            except Exception as e:  # noqa: BLE001 -- every rank must hear of it
                error = e
        try:
            pids = self._agree(os.getpid(), error)
            #: the peers' process ids that this process sees running now (:meth:`dead_peers`);
            #: a peer in another pid namespace (another container) is left out, not dead
            self.watched: dict[int, int] = {r: pid for r, pid in enumerate(pids)
                                            if r != self.rank and _alive(pid)}
        except BaseException:
            self.close()
            raise

    def _agree(self, value: object, error: BaseException | None) -> list:
        """Collective: every rank's ``value``, or an error raised on every rank if any
        rank failed (so no rank waits in a later collective for a peer that gave up)."""
        got: list = [None] * self.size
        mine = (False, f"{type(error).__name__}: {error}") if error else (True, value)
        dist.all_gather_object(got, mine, group=self.group)
        if error is not None:
            raise error
        failed = [f"rank {r}: {msg}" for r, (ok, msg) in enumerate(got) if not ok]
        if failed:
            raise RuntimeError("SharedFileMemory: a peer failed; " + "; ".join(failed))
        return [v for _, v in got]

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        if self._dir is None:
            raise RuntimeError(f"SharedFileMemory: allocate({name!r}) after close()")
        mine = None  # set once we created the file: only then is it ours to unlink
        try:
            error, local = None, None
            try:
                path = os.path.join(self._dir, _new_file_name())
                fd = _create_exclusive(path)
                mine = path
                try:
                    os.ftruncate(fd, nbytes)  # a new file: its bytes read as zero
                    if nbytes:
                        # tmpfs pages now, or ENOSPC here, on every rank: a sparse file on a
                        # full /dev/shm (Docker's default: 64 MiB) maps fine and then kills
                        # the rank with SIGBUS at its first write
                        os.posix_fallocate(fd, 0, nbytes)
                    local = self._tensor(_map(fd, nbytes))
                finally:
                    os.close(fd)
            except Exception as e:  # noqa: BLE001 -- every rank must hear of it
                error = e
            names = self._agree(os.path.basename(mine) if mine else None, error)
            peers, error = [], None
            try:
                for r, file_name in enumerate(names):
                    peers.append(local if r == self.rank
                                 else self._tensor(_map_peer(self._dir, file_name, nbytes)))
            except Exception as e:  # noqa: BLE001
                error = e
            self._agree(None, error)  # past this, every rank has mapped every file
            return PeerBuffer(name, nbytes, self.rank, peers)
        finally:
            # Mapped by every rank, or abandoned: the name is no longer needed either way.
            if mine is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(mine)

    def _tensor(self, mapping: mmap.mmap) -> torch.Tensor:
        """uint8 [len] over a shared ``mapping`` (the tensor keeps the mapping alive).
        A world whose buffers the GPU reaches registers the mapping here (gpu-host)."""
        return torch.frombuffer(mapping, dtype=torch.uint8)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def dead_peers(self) -> list[int]:
        return [r for r, pid in self.watched.items() if not _alive(pid)]

    def close(self) -> None:
        """Rank 0 removes the job directory (and anything a crash left there); the other
        ranks have nothing left, their files being unlinked when each allocation ends.
        Mapped buffers stay valid; a later :meth:`allocate` raises."""
        self._dir = None
        if self._finalizer is not None:
            self._finalizer()


#: the kernel's PF_EXITING task flag (include/linux/sched.h): set as a process starts to
#: exit, before its files close; a killed GPU process can take longer than a spin bound
#: to tear its context down, and must read as dead meanwhile
_PF_EXITING = 0x4


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs: it exists, is not exiting and is
    not a zombie (a killed rank stays one until its launcher reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # fields after the command name, which is in parentheses and may hold spaces:
            # state, ppid, pgrp, session, tty, tpgid, flags, ...
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING


_FILE_NAME = re.compile(r"[0-9a-f]{32}")


def _new_file_name() -> str:
    return secrets.token_hex(16)


def _create_exclusive(path: str) -> int:
    """A new file at ``path``, ours alone: fails if anything is already there."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask: peers check it
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """A shared read-write mapping of ``nbytes`` of ``fd`` (unmapped when collected)."""
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _check_private_dir(path: str) -> None:
    """Raise unless ``path`` is a directory (not a link) of this user with mode 0700."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise RuntimeError(f"SharedFileMemory: job directory {path} not found ({e}); the "
                           "ranks of a cpu-shm world must share one host") from e
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700:
        raise PermissionError(
            f"SharedFileMemory: job directory {path}: expected a directory owned by uid "
            f"{uid} with mode 0700, found {_describe(st)}")


def _map_peer(directory: str, file_name: str, nbytes: int) -> mmap.mmap:
    """Map a peer's file of ``directory``, refusing any file this job did not create."""
    if not isinstance(file_name, str) or not _FILE_NAME.fullmatch(file_name):
        # A name is joined to our directory: no separators, no "..", nothing to escape it.
        raise PermissionError(f"SharedFileMemory: peer file name {file_name!r}: expected "
                              "32 hex digits (a name this job made)")
    path = os.path.join(directory, file_name)
    expected = f"a regular file owned by uid {os.geteuid()}, mode 0600, {nbytes} B"
    try:
        # No O_CREAT: the peer made it; O_NOFOLLOW: a symbolic link is refused.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise PermissionError(f"SharedFileMemory: peer file {path}: cannot open it "
                              f"({e.strerror}); expected {expected}") from e
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size != nbytes
                or not os.path.samestat(st, os.lstat(path))):
            raise PermissionError(f"SharedFileMemory: refusing peer file {path}: expected "
                                  f"{expected}, found {_describe(st)}")
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def _describe(st: os.stat_result) -> str:
    kind = ("directory" if stat.S_ISDIR(st.st_mode) else "regular file"
            if stat.S_ISREG(st.st_mode) else "symbolic link" if stat.S_ISLNK(st.st_mode)
            else "special file")
    return f"a {kind} owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}, " \
           f"{st.st_size} B"


class SymmetricMemory(PeerMemory):
    """One GPU per process: torch symmetric memory, rendezvoused on ``group``."""

    kind = "gpu-symm"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group, self.device = group, device

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        import torch.distributed._symmetric_memory as symm_mem

        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        local.zero_()
        group = self.group if self.group is not None else dist.group.WORLD
        handle = symm_mem.rendezvous(local, group.group_name)
        peers = [local if r == self.rank else handle.get_buffer(r, (nbytes,), torch.uint8, 0)
                 for r in range(self.size)]
        torch.cuda.synchronize(self.device)
        self.barrier()
        return PeerBuffer(name, nbytes, self.rank, peers, _keepalive=[handle])

    def barrier(self) -> None:
        dist.barrier(group=self.group, device_ids=[self.device.index])


class LocalMemory(PeerMemory):
    """A world of one rank: plain memory on its device, no peers."""

    kind = "single"

    def __init__(self, device: torch.device):
        super().__init__(0, 1)
        self.device = device

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        return PeerBuffer(name, nbytes, 0, [torch.zeros(nbytes, dtype=torch.uint8,
                                                        device=self.device)])

    def barrier(self) -> None:
        return None


class PinnedHostGroup:
    """State shared by the W emulated ranks of one process: one buffer set per allocation."""

    def __init__(self, size: int):
        self.size = size
        #: allocation serial -> (name, bytes, the W buffers, ranks yet to take them): held
        #: until every rank has taken its set, then only by the ranks' PeerBuffers
        self._pending: dict[int, tuple[str, int, list[torch.Tensor], set[int]]] = {}
        self._serial = [0] * size

    def buffers(self, rank: int, name: str, nbytes: int) -> list[torch.Tensor]:
        # Ranks allocate in the same order (collective), so the k-th allocation of every
        # rank names the same buffer set whichever rank asks first.
        self._serial[rank] += 1
        serial = self._serial[rank]
        if serial not in self._pending:
            self._pending[serial] = (name, nbytes, [
                torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
                for _ in range(self.size)], set(range(self.size)))
        first_name, first_bytes, bufs, waiting = self._pending[serial]
        if (name, nbytes) != (first_name, first_bytes):
            raise ValueError(f"PinnedHostGroup: rank {rank}'s allocation {serial} is {name!r} of "
                             f"{nbytes} B, another rank's is {first_name!r} of {first_bytes} B "
                             "(allocations are collective: same order and sizes on every rank)")
        waiting.discard(rank)
        if not waiting:
            del self._pending[serial]
        return bufs


class PinnedHostMemory(PeerMemory):
    """One of W emulated ranks on one GPU; buffers in pinned host memory (see module doc)."""

    kind = "gpu-emulated"

    def __init__(self, group: PinnedHostGroup, rank: int):
        super().__init__(rank, group.size)
        self.group = group

    def _allocate(self, name: str, nbytes: int) -> PeerBuffer:
        return PeerBuffer(name, nbytes, self.rank, self.group.buffers(self.rank, name, nbytes))

    def barrier(self) -> None:
        # All emulated ranks live in this process and are driven in program order.
        return None
