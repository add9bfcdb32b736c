"""The real cuda-bindings (``cuda.bindings``: it imports without a GPU) with the host-
registration calls of its ``runtime`` recorded instead of made, so the real binding layer
(``radiance_ar.transport.cuda_ops``) runs on a machine without a GPU; every other name is
the real module's, and the calls return its own ``cudaError_t``. Every call is recorded
with whether its address was mapped by this process at that moment (read from
``/proc/self/maps``): the tests check that registrations are undone while their memory is
still mapped."""

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


def _error(code: int):
    from cuda.bindings import runtime

    return runtime.cudaError_t(code)


def _register(ptr: int, nbytes: int, flags: int) -> tuple:
    CALLS.append(("register", ptr, nbytes, flags, mapped(ptr)))
    return (_error(FAIL_REGISTER[0]),)


def _unregister(ptr: int) -> tuple:
    CALLS.append(("unregister", ptr, None, None, mapped(ptr)))
    return (_error(0),)


def _device_pointer(ptr: int, flags: int) -> tuple:
    return (_error(0), ptr + DEVICE_OFFSET[0])


def install(modules: dict | None = None) -> None:
    """Make ``from cuda.bindings import driver, runtime`` find the real driver and the
    recording runtime, in ``modules`` (default ``sys.modules``: for a process of its own;
    in the test process pass a dict that ``monkeypatch`` restores)."""
    from cuda.bindings import driver as real_driver, runtime as real_runtime

    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.__getattr__ = lambda name: getattr(real_runtime, name)  # every other name
    runtime.cudaHostRegister = _register
    runtime.cudaHostUnregister = _unregister
    runtime.cudaHostGetDevicePointer = _device_pointer
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime, bindings.driver = runtime, real_driver
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    (sys.modules if modules is None else modules).update(
        {"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.runtime": runtime,
         "cuda.bindings.driver": real_driver})
