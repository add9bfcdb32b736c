"""ROCm's captured op calls (radiance_ar.transport.hip_capture) against the real hip-python,
without ROCm: the gate, the parameter layout of hip_runtime_api.h, the runs a batch is cut
into, and the three runtime calls that add each node to a capture, recorded instead of made
(the bindings' own enums, structs and handle types)."""

import ctypes

import pytest
import torch

from radiance_ar.transport import copy_engine, hip_capture
from radiance_ar.transport.copy_engine import CopyEngine, Route
from radiance_ar.transport.runtime_errors import CopyEngineError


@pytest.mark.parametrize("version, forced, host_buffers, says", [
    ("6.3.42131", True, False, "HIP 6.3: no hipGraphAddBatchMemOpNode before HIP 6.4"),
    ("6.4.43482-0f2d60242", False, False, "have not run on an AMD GPU yet; "
                                          "RADIANCE_AR_OP_GRAPHS=on turns them on"),
    ("7.1.25424", True, True, "blit kernels on compute units"),
    ("7.1.25424", True, False, None),
    ("7.15", True, False, None),  # ROCm 10's HIP (hip-python's rocm/version.py)
    (None, True, False, "runtime version None not understood"),
    ("rocm-dev", True, False, "'rocm-dev' not understood")])
def test_the_gate_names_the_runtime_and_needs_to_be_asked(version, forced, host_buffers, says):
    reason = hip_capture.hip_capture_reason(version, forced, host_buffers)
    assert reason is None if says is None else says in reason


def test_the_runtime_version_is_the_loaded_runtimes_decoded(monkeypatch):
    """hip_ops.hip_runtime_version decodes hipRuntimeGetVersion (major * 10_000_000 +
    minor * 100_000 + patch) through the real binding, and where no HIP runtime loads (this
    machine) says so as a CopyEngineError, which the backend's gate turns into a reason."""
    hip = pytest.importorskip("hip").hip
    from radiance_ar.transport import hip_ops

    hip_ops.hip_runtime_version.cache_clear()
    with pytest.raises(CopyEngineError, match="hipRuntimeGetVersion: the HIP runtime could not"):
        hip_ops.hip_runtime_version()
    hip_ops.hip_runtime_version.cache_clear()
    monkeypatch.setattr(hip, "hipRuntimeGetVersion",
                        lambda: (hip.hipError_t.hipSuccess, 71_526_333))  # HIP 7.15.26333
    assert hip_ops.hip_runtime_version() == "7.15"
    hip_ops.hip_runtime_version.cache_clear()


def test_the_parameters_are_laid_out_as_hip_runtime_api_h_has_them():
    # hipStreamBatchMemOpParams: a 48-byte union; operation 0, address 8, value 16,
    # flags 24, alias 32 (hip-python 10.0's wrapper puts flags at 16: docs/history.md)
    P = hip_capture.HipBatchParams
    union = pytest.importorskip("hip").hip.hipStreamBatchMemOpParams_union
    assert ctypes.sizeof(P) == union().c_sizeof() == 48  # the bindings' own size
    assert [getattr(P, f).offset for f in ("operation", "address", "value64", "flags",
                                           "alias")] == [0, 8, 16, 24, 32]


def test_a_batch_is_cut_into_runs_of_one_kind_in_order():
    ops = [("wait_eq", 1, 5), ("wait_geq", 2, 6), ("write", 1, 0), ("write", 2, 0),
           ("wait_eq", 3, 7)]
    assert hip_capture.operation_runs(ops) == [ops[:2], ops[2:4], ops[4:]]
    many = [("write", a, 1) for a in range(600)]
    assert [len(r) for r in hip_capture.operation_runs(many)] == [255, 255, 90]
    assert hip_capture.operation_runs([]) == []


class CapturingHip:
    """hip-python's real ``hip`` module with the capture calls recorded: a stream whose
    capture frontier starts at node 0x100 and moves to each node set as its dependency."""

    def __init__(self, status="hipStreamCaptureStatusActive"):
        self.real = pytest.importorskip("hip").hip
        self.status = getattr(self.real.hipStreamCaptureStatus, status)
        self.frontier = (ctypes.c_void_p * 1)(0x100)  # the stream's last captured node
        self.graph = self.real.ihipGraph.fromObj(0xA000)
        self.nodes = []  # (deps, count, ops read from the parameter array, ctx)
        self.updates = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _ok(self):
        return self.real.hipError_t.hipSuccess

    def hipCtxGetCurrent(self):
        return self._ok(), self.real.ihipCtx_t.fromObj(0xC000)

    def hipStreamGetCaptureInfo_v2(self, stream, deps_out):
        ctypes.c_void_p.from_address(deps_out).value = ctypes.addressof(self.frontier)
        return self._ok(), self.status, 1, self.graph, len(self.frontier)

    def hipGraphAddBatchMemOpNode(self, graph, deps, ndeps, params):
        assert int(graph) == 0xA000 and params.flags == 0 and int(params.ctx) == 0xC000
        array = (hip_capture.HipBatchParams * params.count).from_address(int(params.paramArray))
        ops = [(p.operation, p.address, p.value64, p.flags) for p in array]
        self.nodes.append(([ctypes.c_void_p.from_address(deps + 8 * i).value
                            for i in range(ndeps)], ops))
        return self._ok(), self.real.hipGraphNode.fromObj(0x200 + len(self.nodes))

    def hipStreamUpdateCaptureDependencies(self, stream, nodes, count, flags):
        new = [ctypes.c_void_p.from_address(nodes + 8 * i).value for i in range(count)]
        self.updates.append((stream, new, flags))
        self.frontier = (ctypes.c_void_p * count)(*new)
        return (self._ok(),)


def test_each_run_becomes_a_node_after_the_streams_captured_work(monkeypatch):
    hip = CapturingHip()
    monkeypatch.setattr(hip_capture, "_hip", lambda: hip)
    ops = [("wait_eq", 0x3000, 5), ("wait_eq", 0x3008, 6), ("write", 0x3000, 0),
           ("write", 0x3008, 0)]
    kept = hip_capture.hip_capture_batch(7, ops)
    # hip_runtime_api.h: hipStreamMemOpWaitValue64 4, WriteValue64 5; hipStreamWaitValueEq 1
    assert hip.nodes == [([0x100], [(4, 0x3000, 5, 1), (4, 0x3008, 6, 1)]),
                         ([0x201], [(5, 0x3000, 0, 0), (5, 0x3008, 0, 0)])]
    set_deps = int(hip.hipStreamUpdateCaptureDependenciesFlags.hipStreamSetCaptureDependencies)
    assert hip.updates == [(7, [0x201], set_deps), (7, [0x202], set_deps)]
    assert len(kept) == 2 and [len(a) for a in kept] == [2, 2]  # what the nodes read


def test_a_stream_not_capturing_is_refused(monkeypatch):
    hip = CapturingHip(status="hipStreamCaptureStatusNone")
    monkeypatch.setattr(hip_capture, "_hip", lambda: hip)
    with pytest.raises(CopyEngineError, match="stream 0x7 is not capturing"):
        hip_capture.hip_capture_batch(7, [("write", 0x3000, 1)])
    assert hip.nodes == []


def test_without_rocm_the_capture_says_the_runtime_could_not_be_used():
    pytest.importorskip("hip")
    if torch.version.hip:
        pytest.skip("a ROCm machine: its runtime loads")
    with pytest.raises(CopyEngineError, match="HIP runtime could not be used.*libamdhip64"):
        hip_capture.hip_capture_batch(0, [("write", 1, 1)])


def test_a_peer_copy_inside_a_graph_is_a_plain_async_copy():
    # hipMemcpyPeerAsync has no capture hook in clr: inside a capture it would run at once
    assert Route("hip-peer", 1, 0).in_graph() == Route("hip-default")
    for kept in (Route("hip-nocu"), Route("hip-default"), Route("cuda"), Route("cpu")):
        assert kept.in_graph() == kept


@pytest.mark.parametrize("hip_version", [None, "7.1.25424"])
def test_an_engine_adds_nodes_only_on_rocm_and_only_while_a_graph_is_captured(
        monkeypatch, hip_version):
    pytest.importorskip("hip")
    pytest.importorskip("cuda.bindings")
    monkeypatch.setattr(torch.version, "hip", hip_version)
    added = []
    monkeypatch.setattr(copy_engine, "hip_capture_batch",
                        lambda stream, ops: added.append((stream, ops)) or ["params"])
    engine = CopyEngine(torch.device("cuda", 0))
    engine.batch = eager = lambda stream, ops: None  # whatever was bound is put back
    singles = engine.write_value, engine.wait_value_geq, engine.wait_value_eq
    with pytest.raises(RuntimeError, match="the capture failed"):
        with engine.in_graph() as kept:
            if hip_version:
                engine.batch(3, [("write", 0x10, 1)])
                assert added == [(3, [("write", 0x10, 1)])] and kept == ["params"]
                # a single operation would run at once under HIP's capture: refused
                for single in (engine.write_value, engine.wait_value_geq, engine.wait_value_eq):
                    with pytest.raises(AssertionError, match="inside a ROCm capture"):
                        single(3, 0x10, 1)
            else:  # CUDA's stream capture records the eager operations as they are
                assert engine.batch is eager and kept == []
                assert (engine.write_value, engine.wait_value_geq, engine.wait_value_eq) == singles
            raise RuntimeError("the capture failed")
    assert engine.batch is eager
    assert (engine.write_value, engine.wait_value_geq, engine.wait_value_eq) == singles


def test_buffers_hold_graph_routes_only_while_a_graph_is_captured():
    from radiance_ar.transport.transport_buffers import TransportBuffers
    from radiance_ar.transport.world import single_world
    buffers = TransportBuffers(single_world("cpu"), None, [1], reduced=False,
                               stage_reduced=False)
    peer, local = Route("hip-peer", 1, 0), Route("hip-nocu")
    buffers.pull_routes[("pub", 1)] = (0x1000, peer)
    buffers.publish_routes["pub"] = (0x2000, local)
    eager = buffers.pull_routes, buffers.publish_routes
    with pytest.raises(RuntimeError, match="the capture failed"):
        with buffers.in_graph():
            assert buffers.pull_routes == {("pub", 1): (0x1000, Route("hip-default"))}
            assert buffers.publish_routes == {"pub": (0x2000, local)}
            raise RuntimeError("the capture failed")
    assert (buffers.pull_routes, buffers.publish_routes) == eager
    assert buffers.pull_routes[("pub", 1)][1] is peer


class HostTensorMemory:
    """Peer memory of a symmetric-memory world whose buffers are CPU tensors (no GPU here):
    the transport's flags and inboxes, enough for a capture's stream operations."""
    kind = "gpu-symm"

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def allocate(self, name, nbytes):
        from radiance_ar.transport.peer_memory import PeerBuffer
        return PeerBuffer(name, nbytes, self.rank,
                          [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(self.size)])

    def barrier(self):
        pass

    def dead_peers(self):
        return []


def test_a_capture_on_rocm_turns_every_batch_into_nodes_kept_with_the_round(monkeypatch):
    # The whole stack of CopyTransport.capture_round on ROCm (buffer routes, the engine's
    # node hook, the token round, the capture's end): a call's ready tokens posted and
    # awaited, its done tokens consumed at the graph's end, each batch a node run.
    pytest.importorskip("hip")
    from radiance_ar.call_contract import CallSignature
    from radiance_ar.transport.copy_transport import CopyTransport
    from radiance_ar.transport import tokens
    from radiance_ar.transport.hip_ops import hip_batch
    from radiance_ar.transport.world import World
    monkeypatch.setattr(torch.version, "hip", "7.1.25424")
    nodes = []
    monkeypatch.setattr(copy_engine, "hip_capture_batch",
                        lambda stream, ops: nodes.extend(hip_capture.operation_runs(ops))
                        or [f"params {len(nodes)}"])
    monkeypatch.setattr(tokens, "current_stream_handle", lambda device: 9)  # the capture's
    size, rank = 3, 1
    world = World(rank, size, torch.device("cuda", 0), HostTensorMemory(rank, size))
    transport = CopyTransport(world, "sdma", 1000.0, reduced=False)
    signals, ended = transport.signals, []
    sig = CallSignature(96, 5120, torch.bfloat16, "flags", 384, 4352, 7)
    with transport.capture_round(lambda: ended.append(len(nodes))) as rnd:
        with signals.call(sig):
            signals.post("ready", signals.epoch, 5)
            signals.wait_all(transport.peers, "ready", signals.epoch, 5, "a test call")
            signals.post("done", signals.epoch, 5)
    kinds = [{what for what, _, _ in run} for run in nodes]
    # post ready | wait ready, reset | post done | wait done, reset (the graph's end)
    assert kinds == [{"write"}, {"wait_eq"}, {"write"}, {"write"}, {"wait_eq"}, {"write"}]
    assert [len(run) for run in nodes] == [2, 2, 2, 2, 2, 2]  # W - 1 peers each
    assert ended == [6]  # the capture ended after its last node
    assert rnd.node_params == [f"params {n}" for n in (1, 3, 4, 6)]  # one list per batch
    assert rnd.end_event is None  # ROCm: the host records a replay's end
    assert transport.engine.batch is hip_batch  # eager calls enqueue again


def test_a_callers_entry_barrier_on_rocm_is_three_nodes_in_order(monkeypatch):
    # One batch on CUDA (post mine, wait for theirs, reset): on ROCm a node holds one kind
    # of operation, so the barrier is a node of posts, one of waits, one of resets.
    pytest.importorskip("hip")
    from radiance_ar.call_contract import CallSignature
    from radiance_ar.transport.copy_transport import CopyTransport
    from radiance_ar.transport import tokens
    from radiance_ar.transport.world import World
    monkeypatch.setattr(torch.version, "hip", "7.1.25424")
    nodes = []
    monkeypatch.setattr(copy_engine, "hip_capture_batch",
                        lambda stream, ops: nodes.extend(hip_capture.operation_runs(ops)) or [])
    monkeypatch.setattr(tokens, "current_stream_handle", lambda device: 9)
    size, rank = 3, 1
    world = World(rank, size, torch.device("cuda", 0), HostTensorMemory(rank, size))
    transport = CopyTransport(world, "sdma", 1000.0, reduced=False)
    sig = CallSignature(2048, 5120, torch.bfloat16, "flags", 2048, 4352, 7)
    with transport.capture_round(lambda: None, entry=sig):
        pass
    value = tokens.token_value("entry", 0, sig)
    assert [[(what, v) for what, _, v in run] for run in nodes] == [
        [("write", value)] * 2, [("wait_eq", value)] * 2, [("write", 0)] * 2]
    assert transport.held  # a caller's graph holds the buffers from now on
