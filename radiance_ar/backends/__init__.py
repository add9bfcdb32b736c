"""All-reduce strategies behind one registry, and the worlds they run in.

    >>> from radiance_ar import backends
    >>> backends.names()                 # every registered strategy
    >>> cls = backends.from_env()        # the one RADIANCE_AR_BACKEND names
    >>> ar = cls(world, settings)        # for one rank of a radiance_ar.transport.world.World
    >>> ar.all_reduce(slice_in, out)     # collective

``settings`` is a :class:`radiance_ar.envs.BackendSettings` (every backend knob, validated);
without it a backend reads them from the environment, once. Nothing here imports Triton
or a GPU runtime at import time.
"""

from radiance_ar.backends.interface import Backend
from radiance_ar.backends.registry import from_env, get, names, register

__all__ = ["Backend", "from_env", "get", "names", "register"]
