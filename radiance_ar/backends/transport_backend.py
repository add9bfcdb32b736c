"""The Backend-level plumbing of the backends built on one copy-engine transport.

``sdma`` and ``sdma_wht6`` each hold one :class:`~radiance_ar.transport.copy_transport.CopyTransport`
(``self.transport``) and use only its public interface. This base picks the schedule
from the settings, gates the world, sets where the transport holds compute units, runs
the watchdog where ranks are GPU processes (:mod:`radiance_ar.transport.watchdog`), and
forwards the contract's fault, timing and memory calls (``check``, ``resync``,
``close``, ``start_trace``/``stop_trace``) to the transport. What a call computes, and
in which schedule, is each backend's own.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ClassVar, Iterator

import torch

from radiance_ar.transport.caller_graphs import CallerProgress, caller_capture_reason
from radiance_ar.transport.copy_engine import bindings_reason, platform
from radiance_ar.transport.hip_capture import hip_capture_reason
from radiance_ar.transport.hip_ops import hip_runtime_version
from radiance_ar.transport.runtime_errors import CopyEngineError
from radiance_ar.transport.copy_transport import CopyTransport
from radiance_ar import envs
from radiance_ar.envs import BackendSettings
from radiance_ar.backends.interface import Backend
from radiance_ar.backends.sdma_schedule import COMPUTE_UNITS
from radiance_ar.buffers import keep_until_exit
from radiance_ar.call_contract import CallSignature
from radiance_ar.transport.tokens import TokenRound
from radiance_ar.transport.trace import StepTrace
from radiance_ar.transport.watchdog import Watchdog, watchdog_reason
from radiance_ar.transport.world import KINDS, MAX_WORLD, World


#: hardware queues of one GPU the emulated ranks' streams share on CUDA
#: (envs.EMULATED_RANKS_CUDA_ENV's CUDA_DEVICE_MAX_CONNECTIONS); ROCm: envs.hip_hardware_queues
HARDWARE_QUEUES = 32


def emulated_streams_reason(world: World, call_streams: int) -> str | None:
    """``None``, or why W emulated ranks cannot each keep ``call_streams`` call streams: one
    GPU's ranks would then have more busy streams than hardware queues (each rank: its own,
    the publish lane, the op's side stream and the call streams, or with one call stream, the
    caller's, a decode lane instead), and streams that share a queue can park one rank behind
    another's wait on a flag (docs/design.md, 'Worlds'). On CUDA with one call stream that
    is 32 at W = 8, every queue; ROCm keeps 4 queues unless GPU_MAX_HW_QUEUES says more."""
    if world.kind != "gpu-emulated":
        return None
    hip = platform(world.device) == "hip"
    queues = envs.hip_hardware_queues() if hip else HARDWARE_QUEUES
    per_rank = 3 + call_streams
    if world.size * per_rank <= queues:
        return None
    fix = ("set RADIANCE_AR_SDMA_CALL_STREAMS=1" if call_streams > 1 and world.size * 4 <= queues
           else "raise GPU_MAX_HW_QUEUES before the process starts" if hip
           else "use fewer ranks")
    return (f"{world.size} emulated ranks x {per_rank} streams exceed the GPU's {queues} "
            f"hardware queues{' (GPU_MAX_HW_QUEUES)' if hip else ''}; {fix}")


class TransportBackend(Backend):
    # Class defaults; each instance refines uses_compute_units_while_waiting for its path
    # (see sdma_schedule.COMPUTE_UNITS and ``compute_unit_note``).
    uses_compute_units_while_waiting = False
    capture_safe = False
    waits_on_peers = True
    shared_settings = ("sdma_schedule",)
    #: the emulated world gives ``red`` a device stage (the reduced bytes are computed
    #: into device memory, then published D2H)
    stage_reduced: ClassVar[bool] = False
    #: what limits the world size to MAX_WORLD (for the gate's message)
    world_limit: ClassVar[str] = "the reduce kernel's input limit"
    #: its calls may run on the transport's two call streams (``sdma_call_streams``);
    #: ``sdma_wht6`` publishes every call at offset 0, so its calls could never overlap
    uses_call_streams: ClassVar[bool] = False
    #: its overlapped calls end with a kernel that may run on the transport's decode lane
    #: (:meth:`CopyTransport.decode_beside`)
    decodes_beside: ClassVar[bool] = False

    def __init__(self, world: World, settings: BackendSettings | None = None, *,
                 schedule: str | None = None):
        """``settings``: ``sdma_schedule`` and ``spin_timeout_ms`` (default: the
        environment's). ``schedule`` fixes the schedule whatever the settings say (a
        probe of one schedule); checked alike."""
        if schedule is not None:  # before Backend compares the ranks' settings
            settings = self.settings_or_env(settings).replace(sdma_schedule=schedule)
        super().__init__(world, settings)
        self.schedule = self.settings.sdma_schedule
        self.uses_compute_units_while_waiting, self.compute_unit_note = COMPUTE_UNITS[
            (world.kind, platform(world.device))]
        streams = self.settings.sdma_call_streams if self.uses_call_streams else 1
        reason = emulated_streams_reason(world, streams)
        if reason is not None:
            raise ValueError(f"backend {self.name!r} cannot run here: {reason}")
        self.transport = CopyTransport(world, self.name, self.settings.spin_timeout_ms,
                                       reduced=self.may_use_twoshot(),
                                       stage_reduced=self.stage_reduced,
                                       call_streams=streams, decode_lane=self.decodes_beside)
        self.signals = self.transport.signals
        #: the thread that stops this process when its calls stall for RADIANCE_AR_WATCHDOG_S
        #: (radiance_ar/transport/watchdog.py), or why there is none
        self.watchdog_reason = watchdog_reason(world.kind, self.settings.watchdog_s)
        self.watchdog = None
        #: the counts of op calls in caller's graphs, which the watchdog watches (where
        #: it runs: a caller's capture needs it) and :meth:`caller_capture_round` keeps
        self.caller_progress: CallerProgress | None = None
        #: the token rounds of the caller's graphs, kept as long as the backend: a graph's
        #: nodes may read them at every launch (ROCm) and the caller may replay it any time
        self.caller_rounds: list[TokenRound] = []
        if self.watchdog_reason is None and self.signals is not None:
            self.caller_progress = CallerProgress(world.device)
            self.watchdog = Watchdog(self.signals, self.settings.watchdog_s, world.device,
                                     progress=self.caller_progress)

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
    def generation(self) -> tuple[int, int]:
        """What a captured op call bakes in: the buffers' size (they move when they grow)
        and the resyncs so far (:attr:`CopyTransport.resyncs`)."""
        return self.transport.capacity, self.transport.resyncs

    @property
    def pulled_bytes(self) -> int:
        """Bytes this rank pulled from peers' buffers, cumulative (tests compare wire_bytes)."""
        return self.transport.pulled_bytes

    def check(self, timeout_ms: float | None = None) -> None:
        """Host-side bounded wait for every call enqueued so far (GPU); raises naming a
        missing peer (:meth:`radiance_ar.transport.gpu_signals.GpuSignals.check`). CPU: waits are inline."""
        self.transport.check(timeout_ms)

    def resync(self) -> None:
        """Collective (:meth:`Backend.resync`); see :meth:`CopyTransport.resync` (emulated:
        ``check`` on every rank first; refused in gpu-symm)."""
        self.transport.resync()

    @property
    def held(self) -> bool:
        """A caller's CUDA graph holds the transport's buffers (they may not grow or go)."""
        return self.transport.held

    @held.setter
    def held(self, value: bool) -> None:
        self.transport.held = value

    def close(self) -> None:
        if self.held:  # the graph's buffers and counts, and the watchdog that bounds it
            keep_until_exit(self, f"backend {self.name!r} closed")
            return
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        self.transport.close()

    def replay_reason(self, forced: bool = False) -> str | None:
        if self.world.size == 1:
            return "one rank: the op's all-reduce is a copy"
        if self.world.device.type != "cuda":
            return f"{self.world.device.type}: captured op calls need a GPU"
        if platform(self.world.device) == "hip":
            try:
                version = hip_runtime_version()
            except CopyEngineError as e:
                return f"the HIP runtime's version is unknown ({e}); captured op calls are off"
            reason = hip_capture_reason(version, forced, self.world.host_buffers)
            if reason is not None:
                return reason
        if self.transport.trace is not None:
            return "a step trace is recording (it times each step as it is enqueued)"
        if not forced and self.transport.peers_parked_here:
            # One host thread drives every rank: a capture made while a peer's replay is
            # parked on this rank's flags blocks for good in capture_end (H200, W = 4,
            # CUDA 13.0, tools/results/2026-12-04-h200-graphs/). Timing with passive peers
            # parks no stream; a process per GPU only waits for its peers.
            return ("emulated ranks with active peers (one process: a capture can block "
                    "while a peer's stream waits on this rank); RADIANCE_AR_OP_GRAPHS=on "
                    "forces it")
        return None

    def capture_round(self, end: Callable[[], None]) -> contextlib.AbstractContextManager:
        return self.transport.capture_round(end)

    def caller_capture_reason(self, graphs: str) -> str | None:
        return caller_capture_reason(graphs, self.replay_reason(forced=graphs == "on"),
                                     self.watchdog_reason)

    @contextlib.contextmanager
    def caller_capture_round(self, sig: CallSignature) -> Iterator[None]:
        """Around one op call (signature ``sig``) captured by a caller: counted entered and
        left for the watchdog, opened by the entry barrier, closed by consuming every done
        token (:mod:`radiance_ar.transport.caller_graphs`)."""
        assert self.caller_progress is not None, "caller_capture_reason lets no capture here"
        self.caller_progress.enter(sig)
        with self.transport.capture_round(lambda: None, entry=sig) as rnd:
            yield
        self.caller_progress.leave()
        self.caller_rounds.append(rnd)

    @contextlib.contextmanager
    def replay_call(self, sig: CallSignature, captured: TokenRound):
        # a caller on the default stream replays on the transport's own stream, like its
        # eager calls: a stream operation given handle 0 (the reuse fence of before_replay)
        # would not wait for torch's default stream (CopyTransport.call_stream)
        with self.transport.call_stream() as stream, self.signals.call(sig):
            self.transport.before_replay(stream)
            yield
            self.transport.after_replay(captured, stream)

    def overlapped_calls(self) -> contextlib.AbstractContextManager:
        return self.transport.overlapped()

    def start_trace(self) -> StepTrace | None:
        return self.transport.start_trace()

    def stop_trace(self) -> None:
        self.transport.stop_trace()
