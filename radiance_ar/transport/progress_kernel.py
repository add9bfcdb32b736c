"""One word of host-visible progress counted by the GPU: the count a caller's graph keeps.

A stream memory operation writes a fixed value, and a replayed graph repeats it: a
marker written that way cannot tell two healthy replays from one stuck replay. So the
op calls a caller captures count on the device, one program (its scalar stores made by one lane)::

    words[LAST]  = ident                      (which == 0, entered, only)
    words[which] = words[which] + 1

``words`` is this rank's alone (one writer: its stream, in stream order, so no atomic
is needed), in pinned host memory, and written through, so the host reads each count
without a device synchronization (:mod:`radiance_ar.transport.caller_graphs`). On the H200
a Triton kernel reads and writes pinned host memory by address with correct results
(:mod:`radiance_ar.launch.pointers`).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: the word the newest entered call's ident goes to (the counters are words 0 and 1)
LAST = 2


# The ident is not specialized on: each op call a caller captures passes a new one (Triton
# would compile a variant for 1 and for multiples of 16), and a variant compiled inside a
# global-mode capture would load a module there, which the capture refuses.
@triton.jit(do_not_specialize=["ident"])
def count_progress_kernel(
    words_ptr,       # int64 [>= 3] in pinned host memory (by address): entered, left, ident
    ident,           # what the entered call is (an index the host keeps), stored at LAST
    WHICH: tl.constexpr,  # the counter to add 1 to: 0 entered, 1 left
    LAST_WORD: tl.constexpr,  # the word ``ident`` goes to
):
    if WHICH == 0:  # the ident first: a host that sees the new count sees its call
        tl.store(words_ptr + LAST_WORD, ident.to(tl.int64), cache_modifier=".wt")
    count = tl.load(words_ptr + WHICH, volatile=True)
    tl.store(words_ptr + WHICH, count + 1, cache_modifier=".wt")
