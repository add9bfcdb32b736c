"""A captured graph's stream memory operations, on the GPU: what captured op calls rest on.

One graph, captured through the copy engine as an op call captures its tokens
(``CopyEngine.in_graph``: on CUDA the stream capture records ``cuStreamBatchMemOp``; on
ROCm explicit batch nodes, :mod:`radiance_ar.transport.hip_capture`), over two words of
pinned host memory the host can read and write while the stream waits::

    graph: write A = 7 | wait B == 5, then reset B = 0 (one batch) | write A = 9

Replayed twice: each time the stream must stop at the wait (A reads 7, the replay is
unfinished), pass once the host posts B = 5, reset B and write A = 9. The second replay
must stop again: a token reset by the first replay cannot let it through (the one-use
tokens of docs/design.md 3.6). Every host wait is bounded; a failure posts B so that the
stream is never left blocked.
"""

import os
import sys
import time

import pytest
import torch

from radiance_ar.transport.copy_engine import CopyEngine, dedicated_stream, platform
from radiance_ar.transport.hip_capture import hip_capture_reason
from radiance_ar.transport.hip_ops import hip_runtime_version

pytestmark = pytest.mark.gpu
BOUND_S = 5.0
POISON = 0x5A5A5A5A


def wait_for(ready, deadline_s=BOUND_S):
    """Poll ``ready()`` up to ``deadline_s``; returns whether it held."""
    end = time.monotonic() + deadline_s
    while not ready():
        if time.monotonic() > end:
            return False
        time.sleep(1e-3)
    return True


def test_a_captured_wait_stops_each_replay_until_its_token_and_consumes_it():
    dev = torch.device("cuda", torch.cuda.current_device())
    if platform(dev) == "hip":
        reason = hip_capture_reason(hip_runtime_version(), forced=True, host_buffers=False)
        if reason is not None:
            pytest.skip(reason)
    # A poisoned, B no token. NVIDIA writes and compares the low 32 bits: the high ones stay 0
    words = torch.tensor([POISON, 0], dtype=torch.int64).pin_memory()
    engine = CopyEngine(dev)
    a, b = (engine.device_address(words[i:i + 1]) for i in range(2))
    stream = dedicated_stream(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            with engine.in_graph() as node_params:
                engine.batch(stream.cuda_stream, [("write", a, 7)])
                engine.batch(stream.cuda_stream, [("wait_eq", b, 5), ("write", b, 0)])
                engine.batch(stream.cuda_stream, [("write", a, 9)])
        finally:
            graph.capture_end()
    assert words.tolist() == [POISON, 0]  # capture ran nothing
    done = torch.cuda.Event()
    try:
        for replay in range(2):
            with torch.cuda.stream(stream):
                graph.replay()
                done.record(stream)
            assert wait_for(lambda: int(words[0]) == 7), (replay, words.tolist())
            time.sleep(0.05)
            assert not done.query(), f"replay {replay} passed its wait before the token"
            assert int(words[0]) == 7
            words[1] = 5  # the token
            assert wait_for(done.query), (replay, words.tolist())
            assert words.tolist() == [9, 0], (replay, words.tolist())  # reset, then A = 9
    finally:
        words[1] = 5  # never leave the stream blocked
        if not wait_for(done.query):
            # a stream that ignores its token cannot be freed, and a process whose stream
            # waits cannot exit: stop here, bounded, rather than hang the run
            print(f"the captured wait ignored its token: {words.tolist()}", file=sys.stderr,
                  flush=True)
            os._exit(1)
        torch.cuda.synchronize(dev)
    assert (platform(dev) == "hip") == bool(node_params)  # ROCm keeps what its nodes read
