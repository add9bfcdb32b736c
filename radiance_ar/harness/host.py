"""The measuring process's host side, set up as a serving process sets up its own.

A Python garbage collection walks every object the process holds; with torch, Triton and
the CUDA bindings imported that is a long walk, and one that lands inside an op call adds
its time to the call's host time. vLLM (``freeze_gc_heap`` after warm-up) and SGLang
(``freeze_gc``) freeze the heap once their model is loaded, so a collection later walks only
what was allocated since. The timing tools do the same before each timed function: on the
H200 the host time of one sdma op call (8192 rows, S = 8) ranged 1.7-4.4 ms across
processes with the collector as it comes, and ran 2.2 ms with it off
(tools/results/2026-12-03-h200-call-streams/variants.log). Also here: the process's resident
memory, which the tools and tests that hold memory flat read.
"""

from __future__ import annotations

import gc
import os


def resident_bytes(statm: str = "/proc/self/statm") -> int | None:
    """This process's resident memory in bytes (Linux), or None where it cannot be read."""
    try:
        with open(statm) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def freeze_heap() -> None:
    """Collect once, then move every object alive into the collector's permanent
    generation (``gc.freeze``): later collections skip them."""
    gc.collect()
    gc.freeze()
