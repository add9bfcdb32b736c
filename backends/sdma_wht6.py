"""``sdma_wht6``: the sdma transport moving wht6 payloads -- codec bytes, DMA waits.

The byte savings of the 6.25-bit codec (:mod:`backends.wht6`) with a wait that costs no
compute units: encode this rank's slice on the CUs into its peer-visible buffer, let
the copy engines pull every peer's payload (stream wait-value on the peer's ``ready``
flag, then a copy: no kernel spins), then ONE decode-accumulate kernel sums all W
payloads in rank order (fp32, one inverse rotation, rounded once). Each rank decodes
its own payload too, so every rank sums identical values and holds identical bits.

One call of rank r, epoch t (one-shot only: a two-shot would quantize twice)::

    stream r : fence | encode(slice) -> pub_r (emulated: -> stage, D2H -> pub_r on the lane)
               | ready_r = t | for p: wait ready_p >= t, pull pub_p -> recv_p
               | done_r = t | decode_accumulate(pub_r.., recv_p..) -> out

The fence, flags, epochs and pulls are the copy-engine transport's, the one ``sdma``
uses too (:mod:`backends.copy_transport`; this backend holds its own instance);
payloads always start at offset 0 of ``pub``, so the fence orders each call's encode
after every peer finished pulling the previous call's payload.

wire_bytes = (W-1) x payload bytes = (W-1) x numel x 25/32: 39% of sdma one-shot's.
"""

from __future__ import annotations

import torch

from backends import wht6
from backends.envs import BackendSettings
from backends.interface import (check_capacity_args, check_slice, copy_unless_same,
                                current_stream_handle, refuse_growth_in_capture)
from backends.registry import register
from backends.trace import traced
from backends.transport_backend import TransportBackend
from backends.world import World


@register("sdma_wht6")
class SdmaWht6Backend(TransportBackend):
    bit_exact = False  # quantized; still identical bits on every rank
    rel_rms_bound = wht6.SUM_REL_RMS_BOUND
    peer_visible_input = False  # the GEMM writes scratch; the payload is what peers read
    world_limit = f"decode_accumulate's limit of {wht6.MAX_PAYLOADS} payloads"

    def __init__(self, world: World, settings: BackendSettings | None = None):
        """``settings``: ``spin_timeout_ms`` (default: the environment's); the schedule is
        one-shot whatever ``sdma_schedule`` says."""
        super().__init__(world, settings, schedule="oneshot")
        self.cols = 0  # columns of the last ensure_capacity (payload layout for timing)

    @classmethod
    def unsupported_cols_reason(cls, cols: int) -> str | None:
        return wht6.cols_reason(cols)

    def wire_bytes(self, numel: int, world_size: int, elem_size: int = 2) -> int:
        return (world_size - 1) * wht6.payload_bytes(numel) if world_size > 1 else 0

    def ensure_capacity(self, max_rows: int, cols: int, dtype: torch.dtype) -> None:
        check_capacity_args(self.name, max_rows, cols, dtype)
        rows, row_bytes = wht6.payload_shape(max_rows, cols)
        if cols != self.cols and self.world.device.type == "cuda" and self.world.size > 1:
            self._warm_codec(cols, dtype)
        self.cols = cols
        self.transport.ensure_capacity(rows * row_bytes)

    def _warm_codec(self, cols: int, dtype: torch.dtype) -> None:
        """Compile and load the codec kernels now, for the reason given in
        :func:`backends.kernels.reduce_sum.warm_up` (a first module load can synchronize
        the device while an emulated rank's stream waits on a flag). Triton compiles one
        variant per divisibility of ``n_sub = rows * cols / 32`` by 16: 1 and 2 rows give
        both where both exist. Warming 1 row only leaves a variant to compile at a first
        call, while a rank's stream may wait on a peer (docs/history.md)."""
        refuse_growth_in_capture("sdma_wht6 codec warm-up", self.world.device)
        for rows in (1, 2):
            x = torch.zeros(rows, cols, dtype=dtype, device=self.world.device)
            payload = wht6.encode(x)
            wht6.decode_accumulate([payload] * self.world.size, (rows, cols), dtype)
        torch.cuda.synchronize(self.world.device)

    def all_reduce(self, slice_in: torch.Tensor, out: torch.Tensor) -> None:
        check_slice(slice_in, out)
        rows, cols = slice_in.shape
        if self.world.size == 1:
            copy_unless_same(slice_in, out)
            return
        tr = self.transport
        shape = wht6.payload_shape(rows, cols)
        nbytes = tr.check_fits(shape[0] * shape[1])
        stream = current_stream_handle(self.world.device)
        with self.signals.call(self.signature(slice_in)) as t:
            if not tr.emulated:  # the encode below writes the peer-visible buffer itself
                tr.fence(0, nbytes, stream)
            encoded = tr.source("pub")[:nbytes].view(shape)
            with traced(tr.trace, stream, "encode"):
                wht6.encode(slice_in, out=encoded)
            if tr.emulated:  # the D2H publish, fenced, on the publish lane
                tr.publish(t, "ready", tr.pub.local[:nbytes], encoded.view(-1), stream,
                           fence=(0, nbytes))
            else:
                self.signals.post("ready", t, stream)
            pulled = tr.pull_all(t, 0, nbytes, stream, f"{self.name} one-shot all_reduce")
            payloads = [encoded if q == self.world.rank else pulled[q].view(shape)
                        for q in range(self.world.size)]
            with traced(tr.trace, stream, "decode_accumulate"):
                wht6.decode_accumulate(payloads, (rows, cols), out.dtype, out=out)
            tr.finish(t, 0, nbytes, stream)

    def fill_passive_peers(self) -> None:
        """Timing mode (see :meth:`backends.sdma.SdmaBackend.fill_passive_peers`): every
        peer holds valid payloads of rows of ``cols`` columns (repeated rows are again a
        valid payload)."""
        if self.cols == 0:
            raise ValueError("sdma_wht6.fill_passive_peers: call ensure_capacity first")
        g = torch.Generator().manual_seed(0)
        values = torch.randn(64, self.cols, generator=g).to(torch.bfloat16)
        self.transport.fill_passive_peers(wht6.encode(values))
