"""Duck-typed stand-ins of vLLM's RowParallelLinear and its unquantized method: the
attributes the installer reads, no vLLM needed."""

from __future__ import annotations

import torch


class UnquantizedLinearMethod:
    """Stand-in with the class name of vLLM's unquantized method (matched by name)."""


class StandIn(torch.nn.Module):
    """Duck-typed RowParallelLinear: the attributes eligibility reads."""

    def __init__(self, n=24, k=16, *, bias=False, reduce_results=True, tp_size=2,
                 quant=None, return_bias=True, input_is_parallel=True, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(n, k, generator=g).bfloat16(),
                                         requires_grad=False)
        self.bias = torch.zeros(n, dtype=torch.bfloat16) if bias else None
        self.reduce_results, self.tp_size, self.return_bias = reduce_results, tp_size, return_bias
        self.input_is_parallel = input_is_parallel
        self.quant_method = UnquantizedLinearMethod() if quant is None else quant
