"""What every runtime binding of the copy layer shares: its errors and masks (a leaf)."""

from __future__ import annotations

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
#: hipMemcpyKind value of hipMemcpyDeviceToDeviceNoCU (hip_runtime_api.h)
HIP_D2D_NO_CU = 1024

PIP_PACKAGE = {"cuda": "cuda-python", "hip": "hip-python"}


class BindingsMissing(RuntimeError):
    """The Python bindings of the GPU runtime are not installed (message names the package)."""


class CopyEngineError(RuntimeError):
    """A runtime call of the copy layer returned an error code."""
