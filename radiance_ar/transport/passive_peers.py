"""Timing mode of emulated worlds: peers that never call, their buffers already filled.

One GPU has one host link where W real ranks would have W, so the timing tools run ONE
active rank against W-1 passive peers whose payloads and flags are already in host
memory (docs/design.md, 'Worlds'). A backend fills every other rank's peer-visible
regions with real bytes, repeated (never zeros: they can move or reduce faster than
data), then marks that rank's flags passive.
"""

from __future__ import annotations

from typing import Sequence

import torch

from radiance_ar.transport.peer_memory import PeerBuffer


def repeated_bytes(payload: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes (uint8, CPU) repeating ``payload``'s bytes from its first."""
    raw = payload.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
    if raw.numel() == 0:
        raise ValueError("fill_passive_peers: the payload is empty")
    return raw.repeat(-(-nbytes // raw.numel()))[:nbytes]


def make_passive(transport, payload: torch.Tensor) -> None:
    """Every rank but ``transport``'s (a :class:`~radiance_ar.transport.copy_transport.CopyTransport`)
    becomes a passive peer that never calls: its ``pub`` (and ``red``) hold ``payload``'s
    bytes repeated from offset 0, and its flags pass every wait
    (:meth:`radiance_ar.transport.signals.Signals.set_passive`). Host writes: after the
    transport's ``ensure_capacity``, with no call in flight."""
    fill = repeated_bytes(payload, transport.capacity)
    for buf in (transport.buffers.pub, transport.buffers.red):
        if buf is not None:
            fill_other_ranks(buf, transport.world.rank, fill)
    for p in transport.peers:
        transport.signals.set_passive(p)


def fill_other_ranks(buffer: PeerBuffer, rank: int, fill: torch.Tensor,
                     offsets: Sequence[int] = (0,)) -> None:
    """Copy ``fill`` into every rank's ``buffer`` but ``rank``'s, at each byte offset."""
    for peer in range(len(buffer.peers)):
        if peer != rank:
            for off in offsets:
                buffer.peer(peer)[off:off + fill.numel()].copy_(fill)
