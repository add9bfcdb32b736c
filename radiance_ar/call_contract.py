"""The call contract: every collective call is named, matched across ranks, or refused.

A serving system can handle an error; it must never serve a wrong sum. The transports
of this project (:mod:`radiance_ar.transport.signals`) therefore tag every flag they post with the
call it belongs to, and a rank that cannot prove its peers are in the same call raises:

- **Tag.** Each call has a sequence number ``t`` (its epoch, counted alike on every
  rank) and a signature: the slice's rows, columns and dtype, the transport step
  ("flags": the backend's own protocol; "vendor": the decode path's vendor collective)
  and the op-level key the caller sets (``M`` and ``K`` of the whole linear). A flag
  that gates reading a peer's data carries ``tag(t, signature)``; a wait accepts only
  the exact tag of its own call. Another call, another shape, a rank behind or ahead:
  the tag differs, and the waiter raises :class:`CollectiveMismatchError` naming both
  ranks' views (each rank's current call is also written in words its peers can read).
- **Abort word.** A rank that gives up on a call (a timeout, a mismatch, any error
  after its call began) writes the epoch into its abort word. Every waiter reads its
  peers' abort words, so a late rank that arrives after its peer gave up raises
  :class:`PeerAbortedError` instead of pairing with a call nobody finishes.
- **Fault state.** After any such error a backend refuses every call with
  :class:`ResyncRequiredError` until ``resync()`` (collective) has run on every rank.

A call the backend itself refuses before numbering it (its arguments: a bad slice,
rows beyond capacity) and a call from a second thread fault the rank the same way
(``Backend.checking_call``, ``OverlapRuntime.one_call_at_a_time``), so the peer that
made it raises. What no protocol can see: a rank that SKIPS a call because its caller
raised before reaching it, and makes its next call of the same signature within the
spin bound, is indistinguishable from a late rank making the skipped call: both carry
the same number and shape. The layer's number in the signature catches a skip across
layers; a skip between two calls of one layer and shape is caught only when the peer's
wait expires first. After an exception in a forward pass, call ``resync()`` on every
rank before serving again.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch


class CollectiveError(RuntimeError):
    """Base of every error that leaves the ranks out of step (call ``resync()``)."""


class PeerTimeoutError(CollectiveError):
    """A peer did not post a flag within the spin timeout (the message names it)."""


class CollectiveMismatchError(CollectiveError):
    """A peer's flag belongs to another call (another number, shape or path)."""


class PeerAbortedError(CollectiveError):
    """A peer gave up on this call (its abort word is set); this call cannot complete."""


class ResyncRequiredError(CollectiveError):
    """An earlier call failed on this rank: every call is refused until ``resync()``."""


#: codes written in the header words (peers decode them for messages)
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.uint8: 4}
PATH_CODES = {"flags": 1, "vendor": 2}
_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_PATHS = {v: k for k, v in PATH_CODES.items()}
#: the flag value of a cleared tag slot; tags are never 0
NO_TAG = 0


@dataclass(frozen=True)
class CallSignature:
    """What every rank must agree on for one collective call (besides its number)."""

    rows: int
    cols: int
    dtype: torch.dtype
    path: str = "flags"
    key_m: int = 0  # op-level rows of the whole linear (0: a direct all_reduce)
    key_k: int = 0  # op-level inner dimension K (0: unknown)
    #: the layer's number as the installer registered it (0: unregistered): replayed calls
    #: carry no call number in their flags, so a skipped call shows as a mismatch at the
    #: next layer instead (radiance_ar.transport.tokens)
    layer: int = 0
    #: RADIANCE_AR_BACKEND=auto: the tuning table and accuracy class every choice comes
    #: from (``TuningTable.signature_word``, 31 bits; 0: no table), so ranks that would
    #: choose differently meet a mismatch at their first call
    tuning: int = 0

    def words(self) -> list[int]:
        """Four int64 header words: rows, cols, tuning/layer/dtype/path codes, key."""
        assert 0 <= self.layer < 1 << 16 and 0 <= self.tuning < 1 << 31, (self.layer, self.tuning)
        return [self.rows, self.cols,
                self.tuning << 32 | self.layer << 16 | DTYPE_CODES[self.dtype] << 8
                | PATH_CODES[self.path],
                (self.key_m << 32) | (self.key_k & 0xFFFFFFFF)]

    @classmethod
    def from_words(cls, words: list[int]) -> "CallSignature | None":
        rows, cols, codes, key = (int(w) for w in words)
        dtype, path = _DTYPES.get(codes >> 8 & 0xFF), _PATHS.get(codes & 0xFF)
        if dtype is None or path is None:
            return None
        return cls(rows, cols, dtype, path, key >> 32, key & 0xFFFFFFFF, codes >> 16 & 0xFFFF,
                   codes >> 32)

    def hash32(self) -> int:
        return _hash_words(tuple(self.words()))

    def hash31(self) -> int:
        """A positive 31-bit hash, for kernels that take it as an int32 argument."""
        return (self.hash32() >> 1) or 1

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        where = "the vendor all-reduce (decode path)" if self.path == "vendor" else "the sliced path"
        key = f" of a linear with M={self.key_m}, K={self.key_k}" if self.key_m else ""
        key += f" (layer {self.layer})" if self.layer else ""
        key += f", auto tuning {self.tuning:#010x}" if self.tuning else ""
        return f"{self.rows}x{self.cols} {dt} in {where}{key}"


@functools.lru_cache(maxsize=1024)
def _hash_words(words: tuple[int, ...]) -> int:
    # Cached: a run has a few signatures (its linears' slice shapes), hashed once each,
    # not once per slice call.
    return zlib.crc32(repr(words).encode()) & 0xFFFFFFFF


def host_tag(epoch: int, sig: CallSignature) -> int:
    """64-bit tag of host-read flags: the epoch in the high half, the signature hash low,
    so a reader tells "another call" from "another shape"."""
    assert 0 < epoch < 2 ** 31
    return (epoch << 32) | sig.hash32()


def device_tag(epoch: int, sig: CallSignature) -> int:
    """32-bit tag for stream wait-value EQ (NVIDIA compares 32 bits): a hash of both,
    never :data:`NO_TAG`. A stale tag of another call matches with probability 2**-32."""
    tag = zlib.crc32(epoch.to_bytes(8, "little"), sig.hash32()) & 0xFFFFFFFF
    return tag or 1


def tag_epoch(tag: int) -> int:
    """The epoch half of a :func:`host_tag`."""
    return int(tag) >> 32


class FaultState:
    """Refuse every call after a failed one, until ``resync()`` clears it."""

    def __init__(self, owner: str):
        self.owner = owner
        self.fault: str | None = None

    def refuse_if_faulted(self) -> None:
        if self.fault is not None:
            raise ResyncRequiredError(
                f"{self.owner}: an earlier call failed ({self.fault}); every call is refused "
                "until resync() has run on every rank (collective)")

    def record(self, error: BaseException) -> None:
        if self.fault is None:
            self.fault = f"{type(error).__name__}: {str(error)[:200]}"

    def clear(self) -> None:
        self.fault = None
