"""Side lanes of the host-memory worlds: a rank's publishes, and its last decodes, beside its pulls.

In the emulated and gpu-host worlds (peer buffers in pinned or registered host memory) a
rank publishes by a D2H copy into its host buffer and pulls its peers' data by H2D copies.
The host link is full duplex and the GPU has copy engines for each direction, but on
ONE stream the two serialize: a call then costs the sum of its D2H and H2D transfers
(measured: docs/history.md, "The emulated publish lane").
On a real box the same bytes overlap too: peers read my memory over my link's outbound
direction while I read theirs inbound. So the publish runs on the PUBLISH lane::

    caller : --ev_in-->  wait ready_p  pull p (H2D) ...  reduce --ev_red--> ... wait ev_pub
    publish:  wait ev_in  [fence]  copy (D2H)  ready_r=t      wait ev_red  copy  reduced_r=t
                                                                                  --ev_pub-->

The caller joins the lane (waits ``ev_pub``) before the call ends, so everything the
lane read (the GEMM's staging buffer, ``out``) is ordered before the caller's later
work, as if the publish had run on the caller's stream.

The DECODE lane holds the kernel that ends a call of the op's pipeline (sdma_wht6's last
decode), so the next call's pulls need not wait behind it: that kernel waits for the SMs
of the GEMM slice then running, and on the caller's stream the next slice's H2D pulls
waited with it (the slices' calls of one op call, inside ``Backend.overlapped_calls``)::

    caller : wait ready_p  pull s (H2D)  done --ev_in--> wait ready_p  pull s+1 ...  (block end) wait ev_out
    decode :                                  wait ev_in  decode s (waits for SMs)  ...  --ev_out-->

The caller joins the decode lane when the overlapped block ends, as it joins the call
streams there. Streams and events are made once, with the transport, and re-recorded.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from radiance_ar.transport.copy_engine import dedicated_stream


class SideLane:
    """One persistent side stream of a rank, with reusable events: ``steps`` to enter it
    (one per kind of work that may be in flight on it at once) and one to join it."""

    def __init__(self, device: torch.device, steps: int):
        self.device = device
        # its own stream, never one of torch's pool that another rank may hold
        self.stream = dedicated_stream(device)
        self.handle = self.stream.cuda_stream  # the raw handle copies are enqueued on
        self._to_lane = [torch.cuda.Event() for _ in range(steps)]  # ev_in (ev_red)
        self._back = torch.cuda.Event()  # ev_pub / ev_out
        self._used = False

    def start(self, step: int, caller: torch.cuda.Stream) -> int:
        """The lane's stream handle, ordered after the work so far of the ``caller``
        stream: enqueue there. Publish lane: ``step`` 0 is the input publish, 1 the
        reduced shard's (each has its own event: both may be in flight)."""
        event = self._to_lane[step]
        event.record(caller)
        self.stream.wait_event(event)
        self._used = True
        return self.handle

    @contextlib.contextmanager
    def current(self, caller: torch.cuda.Stream) -> Iterator[int]:
        """:meth:`start` (step 0) with the lane made torch's current stream, for kernels
        launched on the current stream (Triton's); yields its handle."""
        handle = self.start(0, caller)
        with torch.cuda.stream(self.stream):
            yield handle

    def join(self, caller: torch.cuda.Stream) -> None:
        """The ``caller`` stream waits for everything enqueued on the lane so far."""
        if self._used:
            self._back.record(self.stream)
            caller.wait_event(self._back)
            self._used = False


class DecodeLane(SideLane):
    """The decode lane (module doc): used only while :attr:`active`, inside a block of
    overlapped calls (:meth:`block`), whose end makes the caller's stream wait for it, and
    not switched off (:meth:`off_while`: inside some graph captures)."""

    def __init__(self, device: torch.device, caller: Callable[[], torch.cuda.Stream]):
        """``caller``: the caller's current stream at a block's end."""
        super().__init__(device, steps=1)
        self._caller = caller
        self._depth = 0  # nesting of block()
        self.off = False

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """A block of overlapped calls; at its end, also when it raises, the caller joins."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._used:
                self.join(self._caller())

    @property
    def active(self) -> bool:
        """Whether kernels go on the lane now (inside a block, not switched off)."""
        return self._depth > 0 and not self.off

    @contextlib.contextmanager
    def off_while(self, off: bool) -> Iterator[None]:
        """With ``off`` True, keep the kernels on their call's stream inside (a capture
        where a forked lane blocks: ``CopyTransport.capture_round``)."""
        was, self.off = self.off, self.off or off
        try:
            yield
        finally:
            self.off = was
