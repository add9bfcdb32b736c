"""The overlap op: a RowParallel linear whose all-reduce hides under its own GEMM.

    >>> from radiance_ar import overlap
    >>> overlap.configure(world)                       # collective, once per process
    >>> out = torch.ops.radiance.linear_ar(x, w, None, "bf16")
    >>> overlap.shutdown()                             # collective: release its memory

See :mod:`radiance_ar.overlap.op` for what the op does and :mod:`radiance_ar.overlap.pipeline` for the timeline.
"""

from radiance_ar.overlap.config import OverlapSettings, from_env
from radiance_ar.overlap.op import forward, linear_ar
from radiance_ar.overlap import producer_mxfp4  # registers producer "mxfp4_w4a8" on import
from radiance_ar.overlap.runtime import OverlapRuntime, build, configure, current, shutdown

__all__ = ["OverlapRuntime", "OverlapSettings", "build", "configure", "current", "forward",
           "from_env", "linear_ar", "producer_mxfp4", "shutdown"]
