"""Op calls inside a CALLER's CUDA graph: where they are allowed, and the progress they count.

vLLM captures its forward into CUDA graphs (every batch size up to its capture limit),
and the op's sliced path then runs inside that capture. Its stream work is the same as in
the op's own captures (:mod:`radiance_ar.overlap.graphs`: one-use tokens, every token
consumed in the same graph), with two differences, because the caller replays the graph
and none of this host's code runs around a replay::

    caller's graph, one op call:
      count entered | post entry -> peers, wait every peer's entry, reset
      | prepare | GEMM slices | ARs of the slices (tokens) | consume every done token
      | count left

- **The entry barrier.** An eager call before the replay may still be read by a peer
  (its bytes of ``pub``); before the op's own replays the host enqueues that reuse fence
  (``CopyTransport.before_replay``), but its waits compare host call numbers that a
  caller's graph would repeat stale. So each captured op call begins by posting an
  ``entry`` token to every peer and waiting for every peer's: a peer posts it on its
  stream after everything before the call, its reads of this rank's bytes included.
  The token's value hashes the op call's signature (M, K, N, dtype, the layer's number):
  ranks in different layers never pass it.
- **The bound.** No host code runs, so :meth:`GpuSignals.check` bounds nothing here; the
  watchdog (:mod:`radiance_ar.transport.watchdog`) does, from two counters the graph
  itself increments (:mod:`radiance_ar.transport.progress_kernel`: fixed-value writes could
  not tell two healthy replays from one stuck one). A call entered and not left, with
  neither count moving for ``RADIANCE_AR_WATCHDOG_S``, stops the process, as a stalled
  eager call does: a released stream would finish the call with wrong bytes, and the
  caller's host has already enqueued what reads them.

What the graph holds must stay put: after a caller's capture, a growth of the backend's
buffers raises (:func:`radiance_ar.buffers.refuse_growth_in_capture`: they are collective),
a growth of the op's scratch pool keeps the old buffer, and closing the backend or the runtime
keeps their buffers, until the process exits (:func:`radiance_ar.buffers.keep_until_exit`).
vLLM's profile run at the largest batch precedes its captures, so its buffers are grown by
then (under ``auto``, only the buffers of that batch's choice).

What it assumes of the caller: its replays run on the stream its eager forward runs on (or
after it), one op call in flight per rank (no two micro-batches replayed on two streams at
once, as vLLM's dual-batch overlap does: their tokens would share words), and its layers registered
(:meth:`OverlapRuntime.register_layer`; the vLLM installer does), so that two layers of one
shape post different entry tokens.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from radiance_ar.call_contract import CallSignature
from radiance_ar.launch.pointers import kernel_pointer

#: words of the progress block: entered, left, the newest entered call's ident
WORDS = 3


def caller_capture_reason(graphs: str, replay_reason: str | None,
                          watchdog_reason: str | None) -> str | None:
    """None if a copy-transport backend's sliced path may run inside a caller's CUDA-graph
    capture, else why not (a pure gate). ``graphs``: RADIANCE_AR_OP_GRAPHS (not ``off``);
    the op's own replays must be possible here (``replay_reason``: the backend's, forced
    where ``graphs`` is ``on``) and the watchdog must run (``watchdog_reason``: None where
    it does). Its GPU test (tests/test_caller_capture_gpu.py) passed on an H200 on
    2026-12-05."""
    if graphs == "off":
        return "RADIANCE_AR_OP_GRAPHS=off: no op call is captured"
    if replay_reason is not None:
        return f"its calls cannot be captured here: {replay_reason}"
    if watchdog_reason is not None:
        return ("a caller's replay runs none of this host's code, so only the watchdog "
                f"bounds its waits on peers, and it does not run: {watchdog_reason}")
    return None


class CallerProgress:
    """One rank's count of the op calls its caller's graphs entered and left (see the
    module doc). ``words``: int64 [WORDS], pinned host memory on a GPU."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        gpu = self.device.type == "cuda"
        self.words = torch.zeros(WORDS, dtype=torch.int64, pin_memory=gpu)
        self._np = self.words.numpy()
        #: the words as the kernel takes them, made once (not queried inside a capture)
        self._arg = kernel_pointer(self.words)
        #: what each captured op call is, by ident - 1
        self._calls: list[str] = []
        # both variants compiled and loaded now, on these very words (the same pointer
        # specialization): a first launch inside a capture would load a module there,
        # which a global-mode capture refuses
        for which in (0, 1):
            self._launch(which, 0)
        if gpu:
            torch.cuda.synchronize(self.device)
        self.words.zero_()

    def _launch(self, which: int, ident: int) -> None:
        from radiance_ar.transport.progress_kernel import LAST, count_progress_kernel

        # on the rank's device: Triton keeps its loaded kernels per device, and a kernel
        # first launched inside a capture would be loaded there
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            count_progress_kernel[(1,)](self._arg, ident, WHICH=which, LAST_WORD=LAST,
                                        num_warps=1)

    def enter(self, sig: CallSignature) -> None:
        """Enqueue, on the current stream, the count of an op call of ``sig`` entered."""
        self._calls.append(sig.describe())
        self._launch(0, len(self._calls))

    def leave(self) -> None:
        """Enqueue, on the current stream, the count of an op call left."""
        self._launch(1, 0)

    def snapshot(self) -> tuple[int, int, int]:
        """(entered, left, the newest entered call's ident) as the host sees them now."""
        left = int(self._np[1])  # left first: never more left than entered in one look
        return int(self._np[0]), left, int(self._np[2])

    def describe(self, ident: int) -> str:
        """What the captured op call of ``ident`` is (its signature's description)."""
        return self._calls[ident - 1] if 0 < ident <= len(self._calls) else f"call {ident}"
