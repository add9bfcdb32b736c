"""One baseline for every row of a comparison (column ``vs base``).

Each row's ``speedup`` is against its serial run: where ranks share a GPU (emulated, or
torchrun ranks sharing one), GEMM then that backend's OWN unsliced AR; under torchrun, one
GPU per rank, GEMM then stock's (the vendor collective). Rows of different backends cannot
be compared by it in the first case. ``vs base`` compares every
row's overlapped op time with ONE arm's, at the same M and producer::

    vs_base = t_ovl_ms(baseline arm, M) / t_ovl_ms(row)        # > 1: faster than the base

The arm is ``backend:S`` (``--baseline``). By default (``tuning.BASELINE_ARMS`` by the
world's kind): ``stock`` unsliced in the CPU and gpu-symm worlds; in the emulated and gpu-host
worlds the spin-wait ``oneshot_wht6`` unsliced, the deployment this project replaces.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterable

from radiance_ar import backends
from radiance_ar.envs import OVERLAP_PLANS
from radiance_ar.overlap import tuning

def parse_arm(text: str) -> tuple[str, int]:
    """``backend`` or ``backend:S`` (S an int >= 1; 1 by default) -> (canonical name, S);
    ``ValueError`` naming what is wrong."""
    name, _, slices = text.partition(":")
    try:
        cls = backends.get(name.strip())
    except ValueError as e:
        raise ValueError(f"--baseline {text!r}: {e}") from None
    s = slices.strip() or "1"
    if not (s.isascii() and s.isdigit() and int(s) >= 1):
        raise ValueError(f"--baseline {text!r}: slices {s!r}: expected an integer >= 1")
    return cls.name, int(s) if cls.pipelined else 1


#: the default arm of a world kind and why it is the base (the package's table, which
#: RADIANCE_AR_BACKEND=auto uses too: it never chooses a configuration slower than it)
default_arm = tuning.baseline_arm
#: "backend unsliced" / "backend S=4"
label = tuning.arm_label


def default_backend(world_kind: str) -> str:
    """The default base backend of ``world_kind`` (its arm's backend)."""
    return default_arm(world_kind)[0][0]


def recorded_plan(slices: int, plan: str) -> str:
    """The plan a case of ``slices`` cut by ``plan`` is recorded with: one slice is every
    plan's, recorded as the default."""
    return plan if slices > 1 else OVERLAP_PLANS[0]


def is_arm(backend: str, slices: int, plan: str, arm: tuple[str, int], arm_plan: str) -> bool:
    """Whether a case or record of ``backend``, ``slices`` and ``plan`` is the arm's, cut by
    ``arm_plan`` (a run's first plan; at one slice any plan: :func:`recorded_plan`)."""
    return (backend, slices) == arm and (slices == 1 or plan == arm_plan)


def with_arm(cases: list, arm: tuple[str, int], plan: str) -> list:
    """``cases`` plus the arm's case at every M (and producer) that lacks it: the arm is
    measured once per M like any other row, cut by ``plan`` (``cases``:
    tools/world_measure.Case)."""
    name, slices = arm
    arm_plan = recorded_plan(slices, plan)
    have = {(c.rows, c.producer) for c in cases if is_arm(c.backend, c.slices, c.plan, arm, plan)}
    extra = []
    for c in cases:
        key = (c.rows, c.producer)
        if key not in have:
            have.add(key)
            extra.append(dataclasses.replace(c, backend=name, slices=slices, timeline=False,
                                             plan=arm_plan, seed=c.rows + slices))
    return cases + extra


def add_vs_base(records: Iterable[dict], arm: tuple[str, int], plan: str) -> None:
    """compare_backends: set ``vs_base`` on every record, the arm's ``t_ovl_ms`` (cut by
    ``plan`` where sliced) at the same M and producer over the record's (None where either
    was not timed, e.g. CPU)."""
    ratio_to_base(records, lambda r: is_arm(r.get("backend"), r.get("slices"), r.get("plan"),
                                            arm, plan),
                  "t_ovl_ms", lambda r: (r.get("M"), r.get("producer")))


def add_prefill_vs_base(records: Iterable[dict], backend: str) -> None:
    """prefill_bench: set ``vs_base`` on every arm, ``backend``'s off arm's prefill time
    over the arm's."""
    ratio_to_base(records, lambda r: (r.get("arm"), r.get("backend")) == ("off", backend),
                  "t_prefill_ms", lambda r: None)


def ratio_to_base(records: Iterable[dict], is_base: Callable[[dict], bool], time_key: str,
                  group: Callable[[dict], Hashable]) -> None:
    """``r["vs_base"] = base[time_key] / r[time_key]`` within each ``group``, the base
    being the group's record ``is_base`` picks; None where either has no time."""
    records = list(records)
    base = {group(r): r.get(time_key) for r in records if is_base(r) and "skipped" not in r}
    for r in records:
        ref, own = base.get(group(r)), r.get(time_key)
        r["vs_base"] = ref / own if ref and own else None
