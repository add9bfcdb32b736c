"""Grow-only persistent buffers: how much to grow, never while a graph is captured, and
what a caller's graph captured kept until the process exits.

It imports only :mod:`radiance_ar.streams`; the transports, the op's scratch pool and the
backends import it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from radiance_ar.streams import capturing

#: what :func:`keep_until_exit` keeps
_kept: list[Any] = []


def grown_size(need: int, current: int, align: int = 1) -> int:
    """The size a grow-only buffer of ``current`` units takes to hold ``need``: at least
    1.5x ``current``, so a warm-up of rising M re-allocates O(log M) times rather than at
    every new high-water mark (docs/history.md), rounded up to a multiple of ``align``."""
    return -(-max(need, current * 3 // 2) // align) * align


def refuse_growth_in_capture(what: str, device: torch.device, held: bool = False) -> None:
    """Raise if the current stream of ``device`` is capturing a CUDA graph, or if ``held``:
    a caller's CUDA graph has captured calls that use the buffer, and replays its address
    (radiance_ar.transport.caller_graphs)."""
    if capturing(device):
        raise RuntimeError(
            f"{what}: growth requested during CUDA-graph capture; call ensure_capacity with "
            "the largest shape before capturing")
    if held:
        raise RuntimeError(
            f"{what}: growth requested after a caller's CUDA graph captured op calls that use "
            "these buffers, which it replays at their address; run the largest M once before "
            "capturing (vLLM's profile run does)")


def keep_until_exit(owner: Any, what: str) -> None:
    """Keep ``owner`` (and so every buffer it holds) alive until the process exits, with a
    warning (``what``: what happens to it, e.g. "backend 'sdma' closed"), once per owner: a
    caller's CUDA graph may replay its addresses (radiance_ar.transport.caller_graphs), and
    freed memory under a replay is a silent wrong result, where memory kept is only memory."""
    if any(kept is owner for kept in _kept):
        return
    _kept.append(owner)
    logging.getLogger("radiance_ar").warning(
        "radiance-ar: %s after a caller's CUDA graph captured calls that use it; kept until "
        "the process exits (a graph replayed later would otherwise use freed memory)", what)
