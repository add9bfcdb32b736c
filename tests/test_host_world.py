"""The gpu-host world without a GPU: the RADIANCE_AR_PEER_MEMORY choice, and its peer memory
(job-private shared files, each mapping registered with the runtime and unregistered
while still mapped, on every path) through the real binding layer over the real CUDA
bindings with their registration calls recorded (tests/recorded_cuda_bindings.py), in
real processes. The GPU half is
tests/test_host_world_gpu.py."""

import mmap
import os
import sys

import pytest
import torch

import recorded_cuda_bindings as recorded
import misuse_jobs
from radiance_ar.harness.cpu_world import CpuWorldPool
from radiance_ar.transport import host_peer_memory as hpm
from radiance_ar.transport.runtime_errors import CopyEngineError
from radiance_ar.transport.world import GpuPlace, choose_peer_memory, from_process_group

CUDA0 = torch.device("cuda", 0)


def place(uuid, peers=(), host="box", index=0):
    return GpuPlace(host, uuid, index, tuple(peers))


def test_auto_picks_host_memory_where_ranks_share_a_gpu_or_lack_peer_access():
    choice, why = choose_peer_memory("auto", [place("A"), place("A")])
    assert choice == "host" and "ranks 0 and 1 share one GPU (cuda:0" in why
    pcie = [place("A", index=0), place("B", index=1)]  # no P2P either way
    choice, why = choose_peer_memory("auto", pcie)
    assert choice == "host" and "rank 0's GPU (cuda:0) cannot access rank 1's" in why
    one_way = [place("A", ["B"], index=0), place("B", index=1)]
    assert choose_peer_memory("auto", one_way)[0] == "host"
    nvlink = [place(u, [v for v in "ABCD" if v != u], index=i) for i, u in enumerate("ABCD")]
    assert choose_peer_memory("auto", nvlink) == (
        "symm", "every rank has a GPU of its own and every pair access each other as peers")
    hosts = [place("A", host="h0"), place("B", host="h1")]
    choice, why = choose_peer_memory("auto", hosts)
    assert choice == "symm" and "span 2 hosts" in why


def test_explicit_choices_are_kept_and_checked():
    shared = [place("A"), place("A")]
    assert choose_peer_memory("symm", shared) == ("symm", "RADIANCE_AR_PEER_MEMORY=symm")
    nvlink = [place("A", ["B"]), place("B", ["A"], index=1)]
    assert choose_peer_memory("host", nvlink) == ("host", "RADIANCE_AR_PEER_MEMORY=host")
    with pytest.raises(ValueError, match="PEER_MEMORY=host: the ranks span 2 hosts"):
        choose_peer_memory("host", [place("A", host="h0"), place("B", host="h1")])
    with pytest.raises(ValueError, match="setting 'p2p': expected one of auto, symm, host"):
        choose_peer_memory("p2p", shared)
    with pytest.raises(ValueError, match="peer_memory 'shm': expected one of auto, symm, host"):
        from_process_group(peer_memory="shm")
    with pytest.raises(TypeError, match="device must be a torch.device, got str 'cpu'"):
        from_process_group(device="cpu")
    with pytest.raises(ValueError, match="peer_memory 'host' is for GPU ranks; CPU ranks share"):
        from_process_group(device=torch.device("cpu"), peer_memory="host")


@pytest.fixture
def recorded_cuda(monkeypatch):
    pytest.importorskip("cuda.bindings")
    modules = {}
    recorded.install(modules)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    recorded.CALLS.clear()
    recorded.FAIL_REGISTER[0] = recorded.DEVICE_OFFSET[0] = 0
    yield recorded
    recorded.FAIL_REGISTER[0] = recorded.DEVICE_OFFSET[0] = 0


def _mapping(tmp_path, nbytes=8192):
    path = tmp_path / "buf"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes)
    os.close(fd)
    return mapping


def test_a_registration_lives_as_long_as_its_views_and_ends_while_mapped(tmp_path, recorded_cuda):
    mapping = _mapping(tmp_path)
    t = hpm.registered_tensor(mapping, hpm.HostRegistration(CUDA0))
    del mapping
    (call,) = recorded.CALLS
    addr = t.data_ptr()
    assert call == ("register", addr, 8192, 0x03, True)  # portable | mapped, while mapped
    view = t[100:200]
    t[150] = 7
    del t
    assert len(recorded.CALLS) == 1 and view[50] == 7  # a view keeps the registration
    del view
    assert recorded.CALLS[1] == ("unregister", addr, None, None, True)  # before the unmap
    assert not recorded.mapped(addr)  # and then unmapped


def test_a_failed_registration_raises_and_a_foreign_device_address_is_undone(tmp_path,
                                                                             recorded_cuda):
    recorded.FAIL_REGISTER[0] = 1  # cudaErrorInvalidValue
    with pytest.raises(CopyEngineError, match=r"cudaHostRegister\(8192 B\) failed"):
        hpm.registered_tensor(_mapping(tmp_path), hpm.HostRegistration(CUDA0))
    assert [c[0] for c in recorded.CALLS] == ["register"]  # nothing registered, nothing undone
    recorded.FAIL_REGISTER[0], recorded.DEVICE_OFFSET[0] = 0, 4096
    recorded.CALLS.clear()
    with pytest.raises(RuntimeError, match="not at its host address.*PEER_MEMORY=symm"):
        hpm.registered_tensor(_mapping(tmp_path), hpm.HostRegistration(CUDA0))
    assert [(c[0], c[4]) for c in recorded.CALLS] == [("register", True), ("unregister", True)]
    with pytest.raises(ValueError, match="has no GPU runtime"):
        hpm.HostRegistration(torch.device("cpu"))


def registered_sharing_job(world):
    """A RegisteredHostMemory over the recording bindings: two allocations, data shared
    across processes, files private and gone, every mapping registered; then the buffers
    dropped (every registration undone while mapped) and close() (directory gone)."""
    recorded.install()
    mem = hpm.RegisteredHostMemory(world.group, CUDA0)
    bufs = [mem.allocate("a", 4096), mem.allocate("flags", 2112)]  # the second: one page
    mem.barrier()
    directory = mem._dir
    out = {"kind": mem.kind, "dir_mode": os.stat(directory).st_mode & 0o777,
           "left": os.listdir(directory)}
    for b in bufs:
        b.local.copy_(torch.arange(b.nbytes) % 251 + world.rank)
    mem.barrier()
    other = 1 - world.rank
    out["shared"] = [bool(torch.equal(b.peer(other), torch.arange(b.nbytes) % 251 + other))
                     for b in bufs]
    out["registered"] = sorted((c[1], c[2], c[3], c[4]) for c in recorded.CALLS)
    # registered in whole pages; the buffers are the bytes asked for
    out["addresses"] = sorted((p.data_ptr(), -(-b.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
                              for b in bufs for p in b.peers)
    out["sizes"] = [(b.nbytes, [p.numel() for p in b.peers]) for b in bufs]
    mem.barrier()
    del bufs, b  # the last references to the tensors: each registration ends here
    out["unregistered"] = [(c[1], c[4]) for c in recorded.CALLS if c[0] == "unregister"]
    mem.barrier()
    mem.close()
    mem.barrier()
    out["dir_after_close"] = os.path.exists(directory)
    return out


def test_registered_host_memory_in_real_processes():
    pytest.importorskip("cuda.bindings")
    with CpuWorldPool(2) as pool:  # its own pool: the jobs install the recording bindings
        out = pool.run(registered_sharing_job)
    for r, o in enumerate(out):
        assert o["kind"] == "gpu-host" and o["dir_mode"] == 0o700 and o["left"] == [], r
        assert o["shared"] == [True, True], r
        assert o["sizes"] == [(4096, [4096, 4096]), (2112, [2112, 2112])], r
        # every mapping of this rank (its own two and its peer's two) registered, mapped,
        # portable and mapped-to-device
        assert o["registered"] == [(a, n, 0x03, True) for a, n in o["addresses"]], r
        assert sorted(o["unregistered"]) == [(a, True) for a, _ in o["addresses"]], r
        assert not o["dir_after_close"], r


@pytest.mark.parametrize("size,backend", [(2, "sdma"), (4, "sdma"), (2, "oneshot_wht6")])
def test_a_killed_peer_is_named_dead_on_every_survivor_within_the_bound_and_leaves_nothing(
        size, backend):
    """The CPU world's half of the killed-peer contract (the GPU's: test_host_world_gpu).
    At W = 4 the survivors also wait on each other, and one that gave up sets its abort
    word: every survivor must still name the dead rank, not a live one that waited."""
    with CpuWorldPool(size) as pool:
        res = pool.run(misuse_jobs.killed_peer_job, backend, 200.0, dying=(size - 1,),
                       timeout_s=120)
        assert pool.closed
    assert res[-1] is None
    for rank, r in enumerate(res[:-1]):
        (call,) = r["calls"]
        assert call["error"] == "PeerTimeoutError" and call["seconds"] < 2.0, (rank, call)
        assert f"peer rank {size - 1} is dead (the process has exited)" in call["message"], (
            rank, call)
    assert not os.path.exists(res[0]["dir"])


def test_the_choice_is_logged_once_per_reason(caplog):
    from radiance_ar.transport import world as world_module

    reason = "ranks 0 and 1 share one GPU (a test of the log)"
    with caplog.at_level("WARNING", logger="radiance_ar"):
        for _ in range(3):
            world_module._log_choice_once("host", reason)
    assert [r.getMessage() for r in caplog.records] == [
        f"radiance-ar peer memory: host (gpu-host world): {reason}"]


def stock_collective_job(world):
    from radiance_ar import backends

    return backends.get("stock")(world).collective


def test_stock_names_its_collective(cpu_world):
    # CPU tensors on a gloo group; a gpu-host world's shared GPU gets "gloo ... host round
    # trip" (tests/test_host_world_gpu.py)
    assert cpu_world(2).run(stock_collective_job) == [
        "torch.distributed.all_reduce on the gloo group"] * 2
