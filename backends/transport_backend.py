"""The Backend-level plumbing of the backends built on one copy-engine transport.

``sdma`` and ``sdma_wht6`` each hold one :class:`~backends.copy_transport.CopyTransport`
(``self.transport``) and use only its public interface. This base picks the schedule
from the settings, gates the world, sets where the transport holds compute units, and
forwards the contract's fault, timing and memory calls (``check``, ``resync``,
``close``, ``start_trace``/``stop_trace``) to the transport. What a call computes, and
in which schedule, is each backend's own.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch

from backends.copy_engine import bindings_reason, platform
from backends.copy_transport import CopyTransport
from backends.envs import BackendSettings
from backends.interface import Backend
from backends.sdma_schedule import COMPUTE_UNITS
from backends.trace import StepTrace
from backends.world import KINDS, MAX_WORLD, World


class TransportBackend(Backend):
    # Class defaults; each instance refines uses_compute_units_while_waiting for its path
    # (see sdma_schedule.COMPUTE_UNITS and ``compute_unit_note``).
    uses_compute_units_while_waiting = False
    capture_safe = False
    waits_on_peers = True
    #: the emulated world gives ``red`` a device stage (the reduced bytes are computed
    #: into device memory, then published D2H)
    stage_reduced: ClassVar[bool] = False
    #: what limits the world size to MAX_WORLD (for the gate's message)
    world_limit: ClassVar[str] = "the reduce kernel's input limit"

    def __init__(self, world: World, settings: BackendSettings | None = None, *,
                 schedule: str | None = None):
        """``settings``: ``sdma_schedule`` and ``spin_timeout_ms`` (default: the
        environment's). ``schedule`` fixes the schedule whatever the settings say (a
        probe of one schedule); checked alike."""
        super().__init__(world, settings)
        if schedule is not None:
            self.settings = self.settings.replace(sdma_schedule=schedule)
        self.schedule = self.settings.sdma_schedule
        self.uses_compute_units_while_waiting, self.compute_unit_note = COMPUTE_UNITS[
            (world.kind, platform(world.device))]
        self.transport = CopyTransport(world, self.name, self.settings.spin_timeout_ms,
                                       reduced=self.may_use_twoshot(),
                                       stage_reduced=self.stage_reduced,
                                       call_streams=self.settings.sdma_call_streams)
        self.signals = self.transport.signals

    def may_use_twoshot(self) -> bool:
        """Whether a call of this instance can run two-shot (then ``red`` is allocated)."""
        return self.schedule in ("auto", "twoshot")

    @classmethod
    def unsupported_reason(cls, world: World) -> str | None:
        kind = world.kind
        if kind not in KINDS:
            return f"world kind {kind!r} is unknown to {cls.name} (known: {', '.join(KINDS)})"
        if world.size > MAX_WORLD:
            return f"world size {world.size} > {MAX_WORLD}, {cls.world_limit}"
        dev = torch.device(world.device)
        if kind == "cpu-shm" and dev.type != "cpu":
            return f"a cpu-shm world on device {dev}"
        if kind.startswith("gpu") and dev.type != "cuda":
            return f"a {kind} world needs a CUDA/ROCm device, got {dev}"
        if dev.type == "cuda" and world.size > 1:
            if not torch.cuda.is_available():
                return "no CUDA/ROCm device is visible"
            return bindings_reason(dev)
        return None

    @property
    def capacity(self) -> int:
        """Bytes of one transport buffer (0: none)."""
        return self.transport.capacity

    @property
    def pulled_bytes(self) -> int:
        """Bytes this rank pulled from peers' buffers, cumulative (tests compare wire_bytes)."""
        return self.transport.pulled_bytes

    def check(self, timeout_ms: float | None = None) -> None:
        """Host-side bounded wait for every call enqueued so far (GPU); raises naming a
        missing peer (:meth:`backends.gpu_signals.GpuSignals.check`). CPU: waits are inline."""
        self.transport.check(timeout_ms)

    def resync(self) -> None:
        """Collective (:meth:`Backend.resync`); see :meth:`CopyTransport.resync` (emulated:
        ``check`` on every rank first; refused in gpu-symm)."""
        self.transport.resync()

    def close(self) -> None:
        self.transport.close()

    def overlapped_calls(self) -> contextlib.AbstractContextManager:
        return self.transport.overlapped()

    def start_trace(self) -> StepTrace | None:
        return self.transport.start_trace()

    def stop_trace(self) -> None:
        self.transport.trace = None
