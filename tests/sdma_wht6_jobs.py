"""Jobs for the sdma_wht6 tests (module-level: the CPU world pickles them by name)."""

from __future__ import annotations

import torch

import overlap
from oneshot_jobs import make_input  # codec-friendly inputs (row scales 2^-4..2^4)
from backends import wht6
from backends.sdma_wht6 import SdmaWht6Backend
from backends.world import World
from overlap.config import OverlapSettings
from overlap.slicing import slice_bounds

DT = torch.bfloat16


def codec_reference(seed: int, call: int, size: int, rows: int, cols: int) -> torch.Tensor:
    """What every rank must hold: the codec's own decode-accumulate of every rank's
    independently encoded input, in rank order."""
    payloads = [wht6.encode(make_input(seed, call, r, rows, cols)) for r in range(size)]
    return wht6.decode_accumulate(payloads, (rows, cols), DT)


def exact_job(world: World, shapes: list, slices: int, seed: int) -> list:
    be = SdmaWht6Backend(world)
    results = []
    for call, (rows, cols) in enumerate(shapes):
        be.ensure_capacity(rows, cols, DT)
        x = make_input(seed, call, world.rank, rows, cols)
        out = torch.full((rows, cols), float("nan"), dtype=DT)
        before = be.pulled_bytes
        bounds = slice_bounds(rows, slices)
        for a, b in zip(bounds[:-1], bounds[1:]):
            be.all_reduce(x[a:b], out[a:b])
        expected = torch.cat([codec_reference(seed, call, world.size, rows, cols)[a:b]
                              for a, b in zip(bounds[:-1], bounds[1:])])
        exact = torch.sum(torch.stack([make_input(seed, call, r, rows, cols).double()
                                       for r in range(world.size)]), dim=0)
        results.append({"out": out, "matches_codec": torch.equal(out, expected),
                        "pulled": be.pulled_bytes - before,
                        "wire": sum(be.wire_bytes((b - a) * cols, world.size)
                                    for a, b in zip(bounds[:-1], bounds[1:])),
                        "rel_rms": ((out.double() - exact).pow(2).mean().sqrt()
                                    / exact.pow(2).mean().sqrt()).item()})
    be.close()
    return results


def op_job(world: World, rows: int, cols: int, k: int, slices: int, seed: int) -> dict:
    rt = overlap.build(world, OverlapSettings(True, "sdma_wht6", 1, slices))
    g = torch.Generator().manual_seed(seed * 100 + world.rank)
    x = torch.randn(rows, k, generator=g).to(DT)
    w = (torch.randn(cols, k, generator=g) / k ** 0.5).to(DT)
    out = overlap.forward(rt, x, w, None, "bf16")
    exact = (x.double() @ w.double().t())
    torch.distributed.all_reduce(exact, group=world.group)
    rt.close()
    return {"out": out, "rel_rms": ((out.double() - exact).pow(2).mean().sqrt()
                                    / exact.pow(2).mean().sqrt()).item()}
