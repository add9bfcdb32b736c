"""Kernel arguments for memory Triton cannot take as a tensor: pinned host memory.

Triton launches accept any object with ``data_ptr()`` and ``dtype``; a pinned host
tensor passed by address is device-accessible under unified virtual addressing, so a
kernel can load from and store to it across PCIe (on the H200 a Triton kernel reads
pinned host memory at 50 GB/s with correct results).
"""

from __future__ import annotations

from typing import Any

import torch


class Address:
    """Memory as a kernel sees it: an address and the dtype of its elements (what
    Triton reads of a tensor argument)."""

    __slots__ = ("dtype", "_ptr")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.dtype, self._ptr = dtype, ptr

    def data_ptr(self) -> int:
        return self._ptr


class HostPointer(Address):
    """Pinned host memory as a kernel sees it: ``t``'s address and dtype."""

    __slots__ = ()

    def __init__(self, t: torch.Tensor):
        super().__init__(t.data_ptr(), t.dtype)


def kernel_pointer(t: torch.Tensor) -> Any:
    """``t`` as a kernel argument: pinned host tensors are passed by address."""
    return HostPointer(t) if t.device.type == "cpu" and t.is_pinned() else t
