"""The publish lane of the host-memory worlds: D2H publishes beside the caller's H2D pulls.

In the emulated and gpu-host worlds (peer buffers in pinned or registered host memory) a
rank publishes by a D2H copy into its host buffer and pulls its peers' data by H2D copies.
The host link is full duplex and the GPU has copy engines for each direction, but on
ONE stream the two serialize: a call then costs the sum of its D2H and H2D transfers
(measured: docs/history.md, "The emulated publish lane").
On a real box the same bytes overlap too: peers read my memory over my link's outbound
direction while I read theirs inbound. So the publish runs on a second stream::

    caller : --ev_in-->  wait ready_p  pull p (H2D) ...  reduce --ev_red--> ... wait ev_pub
    publish:  wait ev_in  [fence]  copy (D2H)  ready_r=t      wait ev_red  copy  reduced_r=t
                                                                                  --ev_pub-->

The caller joins the lane (waits ``ev_pub``) before the call ends, so everything the
lane read (the GEMM's staging buffer, ``out``) is ordered before the caller's later
work, as if the publish had run on the caller's stream. Stream and events are made
once, when the backend sizes its buffers (never during capture), and re-recorded.
"""

from __future__ import annotations

import torch

from radiance_ar.transport.copy_engine import dedicated_stream


class PublishLane:
    """One persistent side stream for a rank's publishes, with three reusable events."""

    def __init__(self, device: torch.device):
        self.device = device
        # its own stream, never one of torch's pool that another rank may hold
        self.stream = dedicated_stream(device)
        self.handle = self.stream.cuda_stream  # the raw handle copies are enqueued on
        self._to_lane = [torch.cuda.Event(), torch.cuda.Event()]  # ev_in, ev_red
        self._back = torch.cuda.Event()  # ev_pub
        self._used = False

    def start(self, step: int, caller: torch.cuda.Stream) -> int:
        """The lane's stream handle, ordered after the work so far of the ``caller``
        stream: enqueue the publish there. ``step`` 0 is the input publish, 1 the reduced
        shard's (each has its own event: both may be in flight)."""
        event = self._to_lane[step]
        event.record(caller)
        self.stream.wait_event(event)
        self._used = True
        return self.handle

    def join(self, caller: torch.cuda.Stream) -> None:
        """The ``caller`` stream waits for every publish enqueued so far."""
        if self._used:
            self._back.record(self.stream)
            caller.wait_event(self._back)
            self._used = False
