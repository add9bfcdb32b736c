"""``stock``: the vendor collective, unsliced -- the baseline every other backend is measured against.

It calls the world's own vendor collective where the world carries one
(``world.all_reduce``; the vLLM installer supplies vLLM's
``tensor_model_parallel_all_reduce``, which picks vLLM's custom AR / QuickReduce / NCCL /
RCCL); elsewhere ``torch.distributed.all_reduce`` on the world's group: NCCL on NVIDIA,
RCCL through torch's "nccl" backend on ROCm, gloo on CPU. With ``stock`` selected the overlap op does
not slice (``pipelined = False``): GEMM, then one all-reduce.

In a gpu-host world whose ranks share one GPU the group is gloo: NCCL refuses two ranks
on one device, so the collective is gloo's, a host round trip (the GPU tensor is copied
to host memory, summed by the CPUs over sockets, copied back). :attr:`StockBackend.collective`
says which collective a backend calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from radiance_ar.backends.interface import Backend, check_slice, copy_unless_same
from radiance_ar.backends.registry import register
from radiance_ar.transport.world import World


@register("stock")
class StockBackend(Backend):
    # NCCL/RCCL kernels occupy SMs/CUs for the whole collective, waiting included.
    uses_compute_units_while_waiting = True
    capture_safe = True
    # Ring/tree reductions sum in the payload dtype in an order that depends on the rank.
    bit_exact = False
    # Partial sums are rounded to bf16 at every hop: about one rounding per rank.
    rel_rms_bound = 2.0 ** -6
    pipelined = False

    @property
    def collective(self) -> str:
        """The collective this backend calls, in words (tools print it beside the world)."""
        return collective_of(self.world)

    @classmethod
    def unsupported_reason(cls, world: World) -> str | None:
        if world.group is None and world.all_reduce is None and world.size > 1:
            return (f"the vendor collective needs a process group; the {world.label} "
                    "world has none")
        return None

    def all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor) -> None:
        check_slice(slice_in, out)
        if self.world.size == 1:
            copy_unless_same(slice_in, out)
            return
        if self.world.all_reduce is not None:
            out.copy_(self.world.all_reduce(slice_in))
            return
        copy_unless_same(slice_in, out)
        dist.all_reduce(out, group=self.world.group)

    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        # Ring all-reduce: reduce-scatter then all-gather, each moving (W-1)/W of the data.
        return 2 * (world_size - 1) * numel * elem_size // world_size


def collective_of(world: World) -> str:
    """Which collective ``stock`` calls in ``world``, in words (module doc)."""
    if world.size == 1:
        return "none (one rank: a copy)"
    if world.all_reduce is not None:
        return "the world's vendor all-reduce (world.all_reduce)"
    backend = dist.get_backend(world.group)
    if backend == "gloo" and world.device.type == "cuda":
        return ("gloo all_reduce: a host round trip (GPU -> host, summed over sockets, -> GPU); "
                "ranks sharing one GPU cannot use NCCL")
    return f"torch.distributed.all_reduce on the {backend} group"
