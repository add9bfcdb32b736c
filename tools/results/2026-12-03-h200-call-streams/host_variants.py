"""Host time of one op call (8192 x 5120, S slices) with two call streams, under one change
each, to find what doubled it at S = 8 (host_cs2_S8.log): run as
``python host_variants.py VARIANT S`` (VARIANT: base, nogc, pool, conn32)."""
import gc
import os
import sys

variant, slices = sys.argv[1], sys.argv[2]
if variant == "conn32":
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"
import torch  # noqa: E402

from backends import call_streams  # noqa: E402
from diagnostics import host_cost  # noqa: E402

if variant == "nogc":
    gc.disable()
if variant == "pool":
    call_streams.dedicated_stream = lambda device: torch.cuda.Stream(device)
sys.exit(host_cost.main(["--backend", "sdma", "--world", "4", "--rows", "8192",
                         "--op-slices", slices, "--calls", "30"]))
