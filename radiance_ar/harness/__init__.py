"""Test and tool harnesses: process pools that host worlds.

    >>> from radiance_ar.harness.cpu_world import CpuWorldPool
    >>> with CpuWorldPool(2) as pool:
    ...     results = pool.run(my_job)       # my_job(world) on every rank
"""
