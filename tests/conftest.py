"""Shared test plumbing: GPU markers skip cleanly without a device; CPU worlds are pooled.

``cpu_world(W)`` returns a :class:`radiance_ar.harness.cpu_world.CpuWorldPool` of W gloo processes,
started once per pytest run and closed at the end (a process start costs seconds).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from radiance_ar import envs
from radiance_ar.harness.cpu_world import CpuWorldPool

# The tools are scripts (run as ``python tools/x.py``, their folder first on the path), not
# a package: the tests import their modules the same way, from one place.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
envs.prepare_cuda_for_emulated_ranks()  # the GPU tests drive emulated ranks; before CUDA starts


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU; none is visible")
    no_multi = pytest.mark.skip(reason="needs >= 2 GPUs under torchrun")
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(no_gpu)
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(no_multi)


@pytest.fixture(scope="session")
def cpu_world():
    pools: dict[int, CpuWorldPool] = {}

    def get(size: int) -> CpuWorldPool:
        pool = pools.get(size)
        if pool is None or pool.closed:
            pool = pools[size] = CpuWorldPool(size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def release():
    """Backends appended here get every flag raised after the test, so that a failed test
    never leaves a stream blocked on a wait-value (the process could not exit). GPU tests."""
    made = []
    yield made
    for be in made:
        if be.signals is not None:
            be.signals.release()
            for p in range(be.world.size):
                be.signals.set_passive(p)
    torch.cuda.synchronize()
