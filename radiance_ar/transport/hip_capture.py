"""ROCm: the stream memory operations of a captured op call, as explicit graph nodes.

On CUDA, stream capture records ``cuStreamBatchMemOp`` like any other stream call, so a
captured op call (:mod:`radiance_ar.overlap.graphs`) is its eager steps enqueued on a
capturing stream. ROCm's stream capture does not record ``hipStreamWaitValue`` /
``hipStreamWriteValue`` before ROCm 10 (its clr changelog), so here each batch of a
capture becomes nodes (one per run of waits or of writes, below) that this module adds to
the graph being captured, in the stream's order::

    hipStreamGetCaptureInfo_v2(stream)        -> the graph, the stream's last nodes
    hipGraphAddBatchMemOpNode(graph, those)   -> a node running the batch in order
    hipStreamUpdateCaptureDependencies(stream, [node], Set)
                                              -> later captured work follows the node

What clr does with these calls (read in its source, hip_graph.cpp, hip_stream_ops.cpp,
hip_peer.cpp; not run here), and what follows:

- ``hipGraphAddBatchMemOpNode`` exists from ROCm 6.4 (marked beta) and refuses a null
  ``ctx``, a ``count`` over 256 and ``flags`` other than 0. The node keeps the POINTER to
  the parameter array and reads it at every launch: the arrays live as long as the graph.
- At launch the node is a one-work-item kernel (``__amd_rocclr_batchMemOp``) that polls
  its waits on a compute unit, as clr runs eager waits too
  (:mod:`radiance_ar.transport.hip_ops`); what that costs the GEMM is not measured. Before
  a fix in later clr the kernel ran a batch's operations concurrently, one work-item each,
  so a node holds operations of one kind only (waits, or writes), in stream order: a wait
  and the reset of its word are two nodes. Its writes are relaxed stores with no release
  barrier before them (``hipStreamWriteValue`` has one); the node starts once the nodes
  before it, the copies of a publish included, have completed.
- The parameter array is laid out by ctypes (:class:`HipBatchParams`): hip-python 10.0's
  wrapper of the member struct drops its anonymous value union and writes ``flags`` where
  ROCm reads the value (docs/history.md).
- ``hipMemcpyPeerAsync`` has no capture hook: under capture it runs at once. Copies inside
  a capture are ``hipMemcpyAsync`` (:meth:`radiance_ar.transport.copy_engine.Route.in_graph`);
  kind NoCU keeps its SDMA preference in a graph's memcpy node, but a copy to or from
  pinned host memory becomes a blit KERNEL there, so host-memory worlds are not captured
  (:func:`hip_capture_reason`).

Written against hip-python and tested on a machine without ROCm
(tests/test_hip_capture.py); NOT run on an AMD GPU, hence off unless asked for.
"""

from __future__ import annotations

import ctypes

from radiance_ar.transport.hip_ops import _hip, _hip_ok
from radiance_ar.transport.runtime_errors import MASK64, CopyEngineError

#: the first ROCm with ``hipGraphAddBatchMemOpNode`` (hip_runtime_api.h: beta)
HIP_BATCH_NODES = (6, 4)
#: operations per batch node (``hipStreamBatchMemOp``'s limit: fewer than 256)
HIP_BATCH_MAX_OPS = 255


class HipBatchParams(ctypes.Structure):
    """One ``hipStreamBatchMemOpParams`` as ``hip_runtime_api.h`` lays it out: a union of
    48 bytes whose wait and write members share this layout (operation at 0, address at 8,
    ``value64`` at 16, flags at 24, alias at 32)."""
    _fields_ = [("operation", ctypes.c_uint32), ("_pad0", ctypes.c_uint32),
                ("address", ctypes.c_uint64), ("value64", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("_pad1", ctypes.c_uint32),
                ("alias", ctypes.c_uint64), ("_pad2", ctypes.c_uint64)]


def hip_batch_params(ops: list[tuple[str, int, int]]) -> ctypes.Array:
    """The parameter array of ``ops``: ``("write", addr, value)``, ``("wait_eq", addr,
    value)`` or ``("wait_geq", addr, value)``, 64-bit as the eager calls
    (:func:`radiance_ar.transport.hip_ops.hip_wait_value`) use them, with the bindings' codes."""
    hip = _hip()
    kinds = hip.hipStreamBatchMemOpType
    params = (HipBatchParams * len(ops))()
    for p, (what, addr, value) in zip(params, ops):
        if what == "write":
            p.operation, p.flags = int(kinds.hipStreamMemOpWriteValue64), 0
        elif what in ("wait_eq", "wait_geq"):
            p.operation = int(kinds.hipStreamMemOpWaitValue64)
            p.flags = int(hip.hipStreamWaitValueEq if what == "wait_eq"
                          else hip.hipStreamWaitValueGte)
        else:
            raise ValueError(f"hip_batch_params: operation {what!r}: expected 'write', "
                             "'wait_eq' or 'wait_geq'")
        p.address, p.value64 = addr, value & MASK64
    return params


def operation_runs(ops: list[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
    """``ops`` cut, in order, into runs of one kind (waits, or writes) of at most 255: each
    run is one node (see the module doc: a node may run its operations concurrently)."""
    runs: list[list[tuple[str, int, int]]] = []
    for op in ops:
        writes = op[0] == "write"
        if not runs or (runs[-1][0][0] == "write") != writes or len(runs[-1]) == HIP_BATCH_MAX_OPS:
            runs.append([])
        runs[-1].append(op)
    return runs


def hip_capture_batch(stream: int, ops: list[tuple[str, int, int]]) -> list[ctypes.Array]:
    """Add ``ops`` (see :func:`hip_batch_params`) to the graph ``stream`` is capturing,
    one node per run (:func:`operation_runs`), each after the stream's captured work so
    far; the stream's next captured work follows the last. Returns the parameter arrays,
    which the caller keeps for as long as the graph lives (the nodes read them at launch)."""
    hip = _hip()
    (ctx,) = _hip_ok("hipCtxGetCurrent", hip.hipCtxGetCurrent)  # must not be null (clr)
    kept = []
    for run in operation_runs(ops):
        params = hip_batch_params(run)
        deps = ctypes.c_void_p()  # the runtime points it at the stream's last nodes
        status, _, graph, ndeps = _hip_ok("hipStreamGetCaptureInfo_v2",
                                          hip.hipStreamGetCaptureInfo_v2, stream,
                                          ctypes.addressof(deps))
        if status != hip.hipStreamCaptureStatus.hipStreamCaptureStatusActive:
            raise CopyEngineError(f"hip_capture_batch: stream {stream:#x} is not capturing "
                                  f"(capture status {getattr(status, 'name', status)})")
        node_params = hip.hipBatchMemOpNodeParams()
        node_params.ctx, node_params.count = ctx, len(params)
        node_params.paramArray, node_params.flags = ctypes.addressof(params), 0
        (node,) = _hip_ok(f"hipGraphAddBatchMemOpNode({len(params)} ops)",
                          hip.hipGraphAddBatchMemOpNode, graph, deps.value or 0, ndeps,
                          node_params)
        after = (ctypes.c_void_p * 1)(int(node))
        _hip_ok("hipStreamUpdateCaptureDependencies", hip.hipStreamUpdateCaptureDependencies,
                stream, ctypes.addressof(after), 1,
                int(hip.hipStreamUpdateCaptureDependenciesFlags.hipStreamSetCaptureDependencies))
        kept.append(params)
    return kept


def _parse_version(hip_version: str | None) -> tuple[int, int] | None:
    try:
        major, minor = (int(p) for p in (hip_version or "").split(".")[:2])
    except ValueError:
        return None
    return major, minor


def hip_capture_reason(hip_version: str | None, forced: bool, host_buffers: bool) -> str | None:
    """Pure gate: ``None`` where the op's sliced calls are captured into graphs on this
    HIP runtime (``hip_version``: :func:`radiance_ar.transport.hip_ops.hip_runtime_version`),
    else why not. ``forced`` (``RADIANCE_AR_OP_GRAPHS=on``) is needed: the path has not run
    on an AMD GPU. ``host_buffers``: the world's peer buffers are host memory."""
    version = _parse_version(hip_version)
    if version is None:
        return (f"HIP runtime version {hip_version!r} not understood; captured op calls "
                "are off")
    have = f"HIP {version[0]}.{version[1]}"
    if version < HIP_BATCH_NODES:
        need = ".".join(map(str, HIP_BATCH_NODES))
        return (f"{have}: no hipGraphAddBatchMemOpNode before HIP {need} (ROCm {need}), and stream capture "
                "does not record hipStreamWaitValue / hipStreamWriteValue; every step is "
                "enqueued")
    if host_buffers:
        return (f"{have}: a graph's copies to or from pinned host memory run as blit kernels "
                "on compute units (clr's memcpy node), which this DMA path exists to avoid; "
                "every step is enqueued")
    if not forced:
        return (f"{have}: captured op calls (explicit batch memory-operation nodes, beta in "
                "ROCm, whose waits poll in a small kernel) have not run on an AMD GPU yet; "
                "RADIANCE_AR_OP_GRAPHS=on turns them on")
    return None
