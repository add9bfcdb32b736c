"""Stand-in CUDA Python bindings (``cuda.bindings.runtime``) for the host-registration calls,
so the real binding layer (``radiance_ar.transport.cuda_ops``) runs on a machine without a
GPU. Every call is recorded with whether its address was mapped by this process at that
moment (read from ``/proc/self/maps``): the tests check that registrations are undone
while their memory is still mapped."""

from __future__ import annotations

import sys
import types

#: (call, address, bytes, flags, mapped then) in call order, this process's
CALLS: list[tuple] = []
#: the error code the next cudaHostRegister returns (0: success), and the device address
#: offset cudaHostGetDevicePointer adds (0: unified addressing, as on the H200)
FAIL_REGISTER = [0]
DEVICE_OFFSET = [0]


def mapped(addr: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def _register(ptr: int, nbytes: int, flags: int) -> tuple:
    CALLS.append(("register", ptr, nbytes, flags, mapped(ptr)))
    return (FAIL_REGISTER[0],)


def _unregister(ptr: int) -> tuple:
    CALLS.append(("unregister", ptr, None, None, mapped(ptr)))
    return (0,)


def _device_pointer(ptr: int, flags: int) -> tuple:
    return (0, ptr + DEVICE_OFFSET[0])


def install(modules: dict | None = None) -> None:
    """Make ``from cuda.bindings import driver, runtime`` find the stand-ins, in
    ``modules`` (default ``sys.modules``: for a process of its own; in the test process
    pass a dict that ``monkeypatch`` restores, never touching real bindings)."""
    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.cudaHostRegister = _register
    runtime.cudaHostUnregister = _unregister
    runtime.cudaHostGetDevicePointer = _device_pointer
    driver = types.ModuleType("cuda.bindings.driver")
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime, bindings.driver = runtime, driver
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    (sys.modules if modules is None else modules).update(
        {"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.runtime": runtime,
         "cuda.bindings.driver": driver})

