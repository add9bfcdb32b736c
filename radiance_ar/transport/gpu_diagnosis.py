"""What a GPU call that did not finish within its bound raises: who is missing, and why.

The host-side bound of :class:`~radiance_ar.transport.gpu_signals.GpuSignals` (``check``, and
the watchdog's ``stalled``) found the newest call unfinished; these methods name the
cause from what the host can see: the waits enqueued since the last check (eager calls)
or the tokens of the graph replayed last, the peers' headers and abort words, and
whether a peer process is gone. A mixin of ``GpuSignals``: it reads that object's state
(``_awaited``, ``_replayed``, ``inbox``, ``epoch``, ``_sig``, ``_host_visible``) and the
messages and reads of :class:`~radiance_ar.transport.signals.Signals`.
"""

from __future__ import annotations

from radiance_ar.call_contract import CollectiveMismatchError, PeerAbortedError, PeerTimeoutError
from radiance_ar.transport.signals import _HEADER, RING, _word


class GpuDiagnosis:
    """The diagnosis half of :class:`~radiance_ar.transport.gpu_signals.GpuSignals`."""

    def _in_call(self, peer: int, epoch: int, value: int) -> bool:
        """Whether ``peer``'s header shows it in the very call whose flag (``value``) is
        awaited: then it is stuck or gone inside that call (between two-shot's phases,
        say), not in another call."""
        peer_epoch, sig, _ = self.peer_header(peer)
        return peer_epoch == epoch and sig is not None and self._make_tag(epoch, sig) == value

    def diagnose(self, waited_ms: float, releasing: bool = True) -> Exception:
        """The error of the newest call, unfinished after ``waited_ms``: a replayed op
        call's (its tokens) or an eager one's (its flags). ``releasing``: the message says
        the stream is released (``_drain`` follows)."""
        replayed = self._replayed  # one read: the watchdog's thread diagnoses too
        if replayed:
            return self._diagnose_tokens(replayed, waited_ms, releasing)
        return self._diagnose(waited_ms, releasing)

    def _diagnose(self, waited_ms: float, releasing: bool = True) -> Exception:
        """The error a call that did not finish within the bound raises: who is missing
        (a peer that gave up, one in another call, or one that never posted); ``releasing``
        as in :meth:`diagnose`."""
        released = (" The blocked stream was released by writing the awaited flag values "
                    "(so the GPU is not left hung); results of that call are garbage."
                    if self._host_visible and releasing else "")
        # a snapshot (one C-level copy): the watchdog diagnoses from its own thread. Waits
        # of calls RING or more before this one are left out: their ring slots hold later
        # calls' tags now (a caller that never checks keeps up to 4 * RING waits)
        stuck = [a for a in list(self._awaited)
                 if self.epoch - a[2] < RING and not self._satisfied(*a[:4])]
        dead = self.dead_error(stuck[0][4] if stuck else "a call")
        if dead is not None:  # named before a live peer that waits on it
            return type(dead)(str(dead) + released)
        if not stuck:
            return PeerTimeoutError(
                f"rank {self.rank}: the stream did not finish within {waited_ms:.0f} ms although "
                "every awaited peer flag is up: the GPU is busy or hung, not waiting on a peer")
        peer, slot, epoch, value, what = stuck[0]
        if self._host_visible and self._read(peer, _HEADER["abort"]):
            return PeerAbortedError(self._aborted_message(peer, what) + released)
        if slot != "done" and self._host_visible and self._read(peer, _HEADER["epoch"]) >= epoch \
                and not self._in_call(peer, epoch, value):
            return CollectiveMismatchError(self._mismatch_message(peer, slot, epoch, what)
                                           + released)
        seen = self._read(peer, _word(slot, epoch))
        also = (f" Also missing: {[(p, s, e) for p, s, e, _, _ in stuck[1:]]}."
                if len(stuck) > 1 else "")
        return PeerTimeoutError(self._timeout_message(peer, slot, epoch, seen, what, waited_ms)
                                + also + released)

    def _diagnose_tokens(self, replayed: list, waited_ms: float, releasing: bool) -> Exception:
        """The error of a replayed op call (its token waits ``replayed``) that did not finish
        within the bound. A consumed token reads 0 like one never posted, so the inbox
        tells only a peer that posted ANOTHER call's token (a mismatch); otherwise the
        peers' headers (written per replay) name the one behind."""
        sig = replayed[0].sig
        mine = f"rank {self.rank} is in call {self.epoch}: a replayed op call, {sig.describe()}"
        released = (" The blocked stream was released by writing the awaited tokens (so the "
                    "GPU is not left hung); results of that call are garbage."
                    if self._host_visible and releasing else "")
        dead = self.dead_error("a replayed op call")
        if dead is not None:
            return type(dead)(str(dead) + released)
        for a in replayed:
            seen = self.inbox.read(a.index)
            if seen not in (None, 0, a.value):
                return CollectiveMismatchError(
                    f"{mine}; peer rank {a.peer}'s {a.kind!r} token for its call {a.k} of the "
                    f"graph holds another call's value ({self._views(a.peer)}): every rank must "
                    "make the same op calls, layer for layer; call resync() on every rank"
                    + released)
        for peer in sorted({a.peer for a in replayed}):
            if self._host_visible and self._read(peer, _HEADER["abort"]):
                return PeerAbortedError(self._aborted_message(peer, "a replayed op call")
                                        + released)
            epoch, theirs, _ = self.peer_header(peer)
            if self._host_visible and (epoch != self.epoch or theirs != self._sig):
                return PeerTimeoutError(
                    f"{mine}; peer rank {peer} did not complete it within {waited_ms:.0f} ms "
                    f"({self._views(peer)}): that rank is missing, late or in another call; "
                    "call resync() on every rank" + released)
        return PeerTimeoutError(
            f"{mine}; it did not finish within {waited_ms:.0f} ms (RADIANCE_AR_SPIN_TIMEOUT_MS "
            "sets the bound): a peer is missing or stuck; call resync() on every rank"
            + released)
