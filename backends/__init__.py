"""All-reduce strategies behind one registry, and the worlds they run in.

    >>> import backends
    >>> backends.names()                 # every registered strategy
    >>> cls = backends.from_env()        # the one RADIANCE_AR_BACKEND names
    >>> ar = cls(world)                  # built for one rank of a backends.world.World
    >>> ar.all_reduce(slice_in, out)     # collective

Nothing here imports Triton or a GPU runtime at import time.
"""

from backends.interface import Backend
from backends.registry import from_env, get, names, register

__all__ = ["Backend", "from_env", "get", "names", "register"]
