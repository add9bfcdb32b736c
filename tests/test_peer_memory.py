"""SharedFileMemory keeps its /dev/shm files private: a 0700 job directory, random 0600
files created exclusively, foreign files refused, nothing left behind (real processes)."""

import os
import re
import stat
import time

import pytest
import torch

from radiance_ar.transport import peer_memory as pm
from radiance_ar.transport import watchdog
from radiance_ar.harness.cpu_world import CpuWorldPool

HEX32 = re.compile(r"[0-9a-f]{32}")


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def private_sharing_job(world):
    """Two allocations on a fresh SharedFileMemory: what the files looked like while alive,
    what is left after, what each rank sees of its peer's writes, and close()."""
    mem = pm.SharedFileMemory(world.group)
    seen_files, created = [], []
    create, map_peer = pm._create_exclusive, pm._map_peer

    def recording_create(path):
        created.append(os.path.basename(path))
        return create(path)

    def recording_map_peer(directory, name, nbytes):
        st = os.lstat(os.path.join(directory, name))
        seen_files.append((stat.S_IMODE(st.st_mode), st.st_uid, st.st_size))
        return map_peer(directory, name, nbytes)

    pm._create_exclusive, pm._map_peer = recording_create, recording_map_peer
    try:
        bufs = [mem.allocate("a", 4096), mem.allocate("b", 100)]
    finally:
        pm._create_exclusive, pm._map_peer = create, map_peer
    directory = mem._dir
    mem.barrier()  # every rank has unlinked its files
    left = sorted(os.listdir(directory))
    zero = [bool((b.local == 0).all()) for b in bufs]
    for b in bufs:
        b.local.copy_(torch.arange(b.nbytes) % 251 + world.rank)
    mem.barrier()
    other = 1 - world.rank
    shared = [bool(torch.equal(b.peer(other), torch.arange(b.nbytes) % 251 + other))
              for b in bufs]
    out = dict(dir=directory, dir_mode=_mode(directory), dir_uid=os.lstat(directory).st_uid,
               files=seen_files, names=created, left=left, zero=zero, shared=shared,
               shapes=[(b.local.dtype, tuple(b.local.shape)) for b in bufs],
               # a watchdog's stop removes the directory too (only its creator holds it)
               removed_at_stop=any(c is mem._finalizer for c in watchdog._at_stop))
    mem.barrier()  # no rank removes the directory while a peer still lists it
    mem.close()
    mem.barrier()  # rank 0 has closed (the group outlives the memory)
    out["exists_after_close"] = os.path.exists(directory)
    with pytest.raises(RuntimeError, match="after close"):
        mem.allocate("c", 8)
    return out


def refused_job(world):
    """A file pre-created at rank 0's next name, then a 0666 file offered by rank 1: both
    refused on every rank, nothing of ours left, and the memory still works after."""
    mem = pm.SharedFileMemory(world.group)
    results = {}
    try:
        squatted = os.path.join(mem._dir, "ab" * 16)
        if world.rank == 0:
            fd = os.open(squatted, os.O_CREAT | os.O_WRONLY, 0o666)
            os.fchmod(fd, 0o666)
            os.write(fd, b"foreign")
            os.close(fd)
            new_name, pm._new_file_name = pm._new_file_name, lambda: "ab" * 16
        mem.barrier()
        try:
            mem.allocate("squatted", 64)
        except Exception as e:  # noqa: BLE001 -- inspected by the test
            results["squatted"] = (type(e).__name__, str(e))
        finally:
            if world.rank == 0:
                pm._new_file_name = new_name
        mem.barrier()
        results["left_squatted"] = sorted(os.listdir(mem._dir))
        mem.barrier()
        if world.rank == 0:
            with open(squatted, "rb") as f:
                results["squatted_content"] = f.read()
            os.unlink(squatted)

        create = pm._create_exclusive
        if world.rank == 1:
            def world_readable(path):
                fd = create(path)
                os.fchmod(fd, 0o666)
                return fd
            pm._create_exclusive = world_readable
        try:
            mem.allocate("foreign", 64)
        except Exception as e:  # noqa: BLE001
            results["foreign"] = (type(e).__name__, str(e))
        finally:
            pm._create_exclusive = create
        mem.barrier()
        results["left_foreign"] = sorted(os.listdir(mem._dir))
        mem.barrier()  # every rank has listed before the next allocation creates files
        results["after"] = mem.allocate("fine", 64).nbytes
    finally:
        mem.barrier()
        mem.close()
    return results


def lone_growth_job(world):
    """Only rank 0 grows: it must give up at the collective timeout, leaving no file."""
    if world.rank != 0:
        return None
    directory = world.memory._dir
    start = time.monotonic()
    try:
        world.memory.allocate("lonely", 4096)
        error = None
    except Exception as e:  # noqa: BLE001
        error = type(e).__name__
    return dict(dir=directory, error=error, seconds=time.monotonic() - start,
                left=os.listdir(directory))


def killed_growth_job(world, marker):
    """Rank 1 dies in the middle of a growth, right after creating its file (as a killed
    process would); rank 0 is left in the growth's collective."""
    if world.rank == 1:
        create = pm._create_exclusive

        def create_then_die(path):
            fd = create(path)
            with open(marker, "w") as f:
                f.write(f"{world.memory._dir}\n{path}")
            os._exit(9)
            return fd

        pm._create_exclusive = create_then_die
    world.memory.allocate("killed", 4096)


def test_a_growth_killed_midway_leaves_nothing_behind(tmp_path):
    marker = tmp_path / "job-dir"
    with CpuWorldPool(2, collective_timeout_s=3) as pool:
        with pytest.raises(Exception, match="died|failed"):
            pool.run(killed_growth_job, str(marker), timeout_s=60)
    job_dir, dead_ranks_file = marker.read_text().split("\n")
    assert os.path.dirname(dead_ranks_file) == job_dir
    # The surviving rank unlinked its own file; the dead rank's file went with the job
    # directory when rank 0 closed: nothing of this job is left in /dev/shm. (Only this
    # job's directory is checked: other radiance-ar jobs may run on the machine.)
    assert not os.path.exists(job_dir), os.listdir(job_dir)


def test_private_files_shared_data_nothing_left(cpu_world):
    pool = cpu_world(2)
    out = pool.run(private_sharing_job)
    uid = os.geteuid()
    # the pool's own directory in /dev/shm holds its jobs' directories (CpuWorldPool.shm_root)
    assert os.path.dirname(pool.shm_root) == "/dev/shm" and _mode(pool.shm_root) == 0o700
    for r, o in enumerate(out):
        assert o["dir"] == out[0]["dir"]
        assert os.path.dirname(o["dir"]) == pool.shm_root
        assert o["dir_mode"] == 0o700 and o["dir_uid"] == uid
        # Each peer file, seen just before it was mapped: ours, 0600, the right size.
        assert o["files"] == [(0o600, uid, 4096), (0o600, uid, 100)], r
        assert o["left"] == [], r
        assert o["zero"] == [True, True] and o["shared"] == [True, True], r
        assert o["shapes"] == [(torch.uint8, (4096,)), (torch.uint8, (100,))]
        assert not o["exists_after_close"]
        assert o["removed_at_stop"] == (r == 0)
    names = [n for o in out for n in o["names"]]
    assert all(HEX32.fullmatch(n) for n in names) and len(set(names)) == len(names), names
    # Random, not a counter: consecutive names of one rank differ in most digits.
    for o in out:
        a, b = o["names"]
        assert sum(x != y for x, y in zip(a, b)) > 16, (a, b)
    assert not os.path.exists(out[0]["dir"])


def test_precreated_and_foreign_files_refused(cpu_world):
    out = cpu_world(2).run(refused_job)
    kind0, msg0 = out[0]["squatted"]
    assert kind0 == "FileExistsError" and "ab" * 16 in msg0
    kind1, msg1 = out[1]["squatted"]
    assert kind1 == "RuntimeError" and "rank 0" in msg1 and "FileExistsError" in msg1
    # The squatter's file is left as it was (not ours to use or unlink); ours are gone.
    assert out[0]["left_squatted"] == ["ab" * 16] == out[1]["left_squatted"]
    assert out[0]["squatted_content"] == b"foreign"
    kind0, msg0 = out[0]["foreign"]
    assert kind0 == "PermissionError" and "mode 0666" in msg0 and "expected" in msg0
    assert re.search(r"refusing peer file /dev/shm/radiance-ar-pool-\w+/radiance-ar-\w+/[0-9a-f]{32}",
                     msg0)
    kind1, msg1 = out[1]["foreign"]
    assert kind1 == "RuntimeError" and "rank 0: PermissionError" in msg1
    assert out[0]["left_foreign"] == [] == out[1]["left_foreign"]
    assert [o["after"] for o in out] == [64, 64]


def test_lone_growth_times_out_and_leaves_nothing():
    pool = CpuWorldPool(2, collective_timeout_s=3)
    try:
        out = pool.run(lone_growth_job, timeout_s=60)[0]
    finally:
        pool.close()
    assert out["error"] is not None and out["seconds"] < 15, out
    assert out["left"] == [], out
    # Rank 0's process exit removed the job directory.
    assert not os.path.exists(out["dir"]), out


def _file(path, mode, nbytes):
    with open(path, "wb") as f:
        f.write(b"\0" * nbytes)
    os.chmod(path, mode)


def test_map_peer_refuses_foreign_files(tmp_path):
    d = str(tmp_path)
    good = "0" * 32
    _file(os.path.join(d, good), 0o600, 64)
    t = pm._map_peer(d, good, 64)
    t[3] = 7  # shared with the file, not a copy
    with open(os.path.join(d, good), "rb") as f:
        assert f.read()[3] == 7
    cases = {"1" * 32: (0o666, 64, "mode 0666"), "2" * 32: (0o600, 32, "32 B")}
    for name, (mode, size, found) in cases.items():
        _file(os.path.join(d, name), mode, size)
        with pytest.raises(PermissionError, match=f"{re.escape(d)}/{name}.*{found}"):
            pm._map_peer(d, name, 64)
    os.symlink(os.path.join(d, good), os.path.join(d, "3" * 32))
    with pytest.raises(PermissionError, match=f"{'3' * 32}: cannot open"):
        pm._map_peer(d, "3" * 32, 64)
    with pytest.raises(PermissionError, match="32 hex digits"):
        pm._map_peer(d, "../" + good[3:], 64)
    with pytest.raises(PermissionError, match="cannot open"):
        pm._map_peer(d, "4" * 32, 64)  # never created: no O_CREAT on a peer's name
    assert not os.path.exists(os.path.join(d, "4" * 32))
    if os.geteuid() == 0:
        _file(os.path.join(d, "5" * 32), 0o600, 64)
        os.chown(os.path.join(d, "5" * 32), 12345, -1)
        with pytest.raises(PermissionError, match="owned by uid 12345"):
            pm._map_peer(d, "5" * 32, 64)


def test_check_private_dir(tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    os.chmod(d, 0o700)
    pm._check_private_dir(str(d))
    os.chmod(d, 0o755)
    with pytest.raises(PermissionError, match=f"{re.escape(str(d))}.*mode 0700.*mode 0755"):
        pm._check_private_dir(str(d))
    os.chmod(d, 0o700)
    os.symlink(d, tmp_path / "link")
    with pytest.raises(PermissionError, match="symbolic link"):
        pm._check_private_dir(str(tmp_path / "link"))
    with pytest.raises(RuntimeError, match="share one host"):
        pm._check_private_dir(str(tmp_path / "missing"))
    if os.geteuid() == 0:
        os.chown(d, 12345, -1)
        with pytest.raises(PermissionError, match="owned by uid 12345"):
            pm._check_private_dir(str(d))


def test_exclusive_create_refuses_existing(tmp_path):
    path = str(tmp_path / ("a" * 32))
    os.close(pm._create_exclusive(path))
    assert _mode(path) == 0o600
    with pytest.raises(FileExistsError):
        pm._create_exclusive(path)
    os.symlink(path, str(tmp_path / "link"))
    with pytest.raises(FileExistsError):  # O_EXCL: a link at the name is not followed
        pm._create_exclusive(str(tmp_path / "link"))


def full_shm_job(world):
    """Rank 1's /dev/shm is full at its growth (posix_fallocate: ENOSPC); what each rank
    raised, and whether the job directory is gone after close()."""
    import errno

    mem = pm.SharedFileMemory(world.group)
    fallocate = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    if world.rank == 1:
        os.posix_fallocate = full
    try:
        mem.allocate("big", 1 << 20)
        raised = None
    except Exception as e:  # noqa: BLE001 -- the test reads what each rank raised
        raised = (type(e).__name__, str(e))
    finally:
        os.posix_fallocate = fallocate
    directory = mem._dir
    mem.barrier()
    mem.close()
    mem.barrier()
    return {"raised": raised, "dir": directory, "exists_after_close": os.path.exists(directory)}


def test_a_full_shm_is_an_error_on_every_rank_not_a_sigbus_at_the_first_write():
    with CpuWorldPool(2, collective_timeout_s=10) as pool:
        out = pool.run(full_shm_job, timeout_s=60)
    assert out[1]["raised"][0] == "OSError" and "No space left" in out[1]["raised"][1]
    assert out[0]["raised"][0] == "RuntimeError" and "rank 1: OSError" in out[0]["raised"][1]
    assert not out[0]["exists_after_close"]


def test_emulated_ranks_pinned_buffers_go_with_their_last_holder_and_must_match(monkeypatch):
    """PinnedHostGroup (one process, W emulated ranks): each allocation's W buffers are
    held by the group only until every rank has taken them (then by their PeerBuffers
    alone: growths free the old sets), and ranks asking for different buffers at the same
    allocation raise instead of each getting a set no peer shares. CPU: unpinned zeros."""
    import gc
    import weakref

    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
    group = pm.PinnedHostGroup(2)
    mems = [pm.PinnedHostMemory(group, r) for r in range(2)]
    old = [m.allocate("pub", 64) for m in mems]
    assert old[0].peer(1) is old[1].local and group._pending == {}
    gone = weakref.ref(old[0].local)
    new = [m.allocate("pub", 96) for m in mems]  # a growth: the old sets are dropped
    del old
    gc.collect()
    assert gone() is None and new[1].peer(0) is new[0].local
    mems[0].allocate("red", 32)
    with pytest.raises(ValueError, match=r"rank 1's allocation 3 is 'red' of 48 B, another "
                                         r"rank's is 'red' of 32 B"):
        mems[1].allocate("red", 48)


def stuck_rank0_job(world, marker):
    """Every rank makes a job directory; rank 0 writes its path, then never returns."""
    mem = pm.SharedFileMemory(world.group)
    if world.rank == 0:
        with open(marker, "w") as f:
            f.write(mem._dir)
        time.sleep(600)


def test_a_pool_whose_rank_0_is_killed_leaves_no_job_directory(tmp_path):
    """A job past its time: the pool kills its ranks, rank 0 with its finalizers unrun;
    the pool's own directory goes with the job directory inside it."""
    marker = tmp_path / "job-dir"
    pool = CpuWorldPool(2, collective_timeout_s=10)
    root = pool.shm_root
    with pytest.raises(Exception, match="within 5 s; pool closed"):
        pool.run(stuck_rank0_job, str(marker), timeout_s=5)
    job_dir = marker.read_text()
    assert os.path.dirname(job_dir) == root
    assert not os.path.exists(job_dir) and not os.path.exists(root)
