"""backends.kernels.launch_cache against a recording stand-in for a @triton.jit kernel:
the first launch of a variant goes through the JIT, later ones of the same variant go to
the compiled kernel with the constexprs appended in signature order, and anything Triton
specializes on (alignment, an int of 1 or a multiple of 16, dtype, constexprs, options)
makes a new variant."""
import pytest
import torch

from backends.kernels.launch_cache import CachedLaunch, variant_key


class Compiled:
    function = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        # as Triton's CompiledKernel.__getitem__ runner, which reads grid[0], [1] and [2]
        assert len(grid) == 3, grid
        return lambda *args: self.log.append(("direct", grid, args))


class Jit:
    arg_names = ["x", "n", "T", "FLAG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)
        return run


def test_second_launch_of_a_variant_is_direct_with_constexprs_in_order():
    jit = Jit()
    launch = CachedLaunch(jit)
    x = torch.zeros(64)
    launch((4,), (x, 32), {"T": 8, "FLAG": True}, {"num_warps": 1})
    launch((5,), (x, 48), {"T": 8, "FLAG": True}, {"num_warps": 1})
    assert jit.log[0] == ("jit", (4,), (x, 32), {"T": 8, "FLAG": True, "num_warps": 1})
    assert jit.log[1] == ("direct", (5, 1, 1), (x, 48, 8, True))


@pytest.mark.parametrize("change", ["misaligned", "int_one", "not_16", "dtype", "constexpr",
                                    "option"])
def test_what_triton_specializes_on_makes_a_new_variant(change):
    x = torch.zeros(64)
    base = ((x, 32), {"T": 8, "FLAG": True}, {"num_warps": 1})
    args, cx, opts = base
    if change == "misaligned":
        args = (x[1:], 32)
    elif change == "int_one":
        args = (x, 1)
    elif change == "not_16":
        args = (x, 33)
    elif change == "dtype":
        args = (x.to(torch.bfloat16), 32)
    elif change == "constexpr":
        cx = {"T": 16, "FLAG": True}
    else:
        opts = {"num_warps": 2}
    assert variant_key(args, cx, opts) != variant_key(*base)
    jit = Jit()
    launch = CachedLaunch(jit)
    launch((1,), *base)
    launch((1,), args, cx, opts)
    assert [entry[0] for entry in jit.log] == ["jit", "jit"]


def test_an_argument_without_a_key_is_refused():
    with pytest.raises(TypeError, match="no variant key"):
        variant_key((object(),), {}, {})
