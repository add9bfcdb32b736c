"""The command line of tools/compare_backends.py: options, their defaults, their checks.

Defaults depend on the device (a CPU world runs the same protocol at sizes two cores
finish in minutes); every option's help states its default.
"""

from __future__ import annotations

import argparse
import os

from radiance_ar import backends
from radiance_ar.envs import OVERLAP_PLANS
from radiance_ar.overlap import producers  # importing overlap registers every producer
import baseline
import producer_inputs

#: committed results live here; a run writes here only when --out-dir names it
TRACKED_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# CPU worlds run the same protocol at sizes two cores finish in minutes; GPU runs use the
# prefill shapes of docs/design.md, 'Measurement' (N=5120, K=4352: one rank's down_proj in the
# model of the deployment this project comes from).
DEFAULTS = {
    "cpu": {"m": [256, 1024], "n": 1024, "k": 1024, "reps": 5, "warmup": 1},
    "gpu": {"m": [2048, 8192, 16384], "n": 5120, "k": 4352, "reps": 30, "warmup": 5},
}
QUICK = {"cpu": {"m": [256], "n": 256, "k": 256, "reps": 3, "warmup": 1},
         "gpu": {"m": [2048, 8192], "n": 5120, "k": 4352, "reps": 10, "warmup": 3}}


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
    return values


def slice_list(text: str) -> list[int | str]:
    """``--slices``: integers >= 1 and ``auto`` (each backend's ``preferred_slices_for``)."""
    words = [v.strip() for v in text.split(",") if v.strip()]
    if not words:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1 or auto")
    return [w if w == "auto" else int_list(w)[0] for w in words]


def _by_device(key: str) -> str:
    """The default of an option that depends on the device, for its help."""
    def text(v):
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)
    return (f"default {text(DEFAULTS['cpu'][key])} on the CPU, {text(DEFAULTS['gpu'][key])} "
            f"on GPUs; with --quick {text(QUICK['cpu'][key])} and {text(QUICK['gpu'][key])}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # Every option's help says its default: "%(default)s" where it is one value, in words
    # where it depends on the device (those default to None here).
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4,
                   help="ranks of the CPU or emulated world (torchrun sets its own); "
                        "default %(default)s")
    p.add_argument("--mode", choices=["auto", "cpu", "emulated"], default="auto",
                   help="auto: torchrun if launched by it, else emulated ranks on a GPU if "
                        "one is visible, else a CPU world; cpu/emulated force that world; "
                        "default %(default)s")
    p.add_argument("--backends", default=None,
                   help="comma-separated backend names; default every registered one "
                        "(RADIANCE_AR_BACKEND picks the op's backend inside vLLM: it is "
                        "validated here like every RADIANCE_AR_* setting, but --backends "
                        "alone chooses what is measured)")
    # --rows / --cols / --inner: the spellings torchrun passes through; it reads --m and
    # --n as abbreviations of its own options (--max-restarts, --nnodes, ...) and stops
    p.add_argument("--m", "--rows", dest="m", type=int_list, default=None,
                   help="rows (tokens) to measure, e.g. 2048,8192; " + _by_device("m"))
    p.add_argument("--n", "--cols", dest="n", type=int, default=None,
                   help="output columns N of the linear; " + _by_device("n"))
    p.add_argument("--k", "--inner", dest="k", type=int, default=None,
                   help="input columns K (this rank's shard); " + _by_device("k"))
    # a string default goes through type= like a typed value: "auto" becomes ["auto"]
    p.add_argument("--slices", type=slice_list, default="auto",
                   help="slice counts S, and auto: each backend's own (what the op runs with "
                        "RADIANCE_AR_OVERLAP_SLICES=auto, its default); default %(default)s")
    p.add_argument("--plans", default=OVERLAP_PLANS[0],
                   help="comma-separated slicing plans of the op (RADIANCE_AR_OVERLAP_PLAN): "
                        f"{', '.join(OVERLAP_PLANS)}; default %(default)s")
    p.add_argument("--producer", default="bf16", choices=producers.names(),
                   help="GEMM producer the op runs, timed alone and in the serial baseline "
                        "too; its weight is the bf16 shard in the producer's format "
                        "(tools/producer_inputs.py) and results are checked against the "
                        "float64 product of the dequantized operands; default %(default)s")
    p.add_argument("--reps", type=int, default=None,
                   help="timed repeats (median reported); " + _by_device("reps"))
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls before timing; " + _by_device("warmup"))
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: fewer M (CPU 256; GPU 2048,8192) and fewer repeats; "
                        "default off")
    p.add_argument("--out-dir", default=None,
                   help="folder for compare.json/.csv/.png; default ./results (never the "
                        "tracked tools/results/ unless named here)")
    p.add_argument("--json", default=None, help="JSON path; default OUT_DIR/compare.json")
    p.add_argument("--no-png", action="store_true",
                   help="skip the PNGs (no matplotlib needed); default off")
    p.add_argument("--baseline", default=None,
                   help="the arm every row is also compared with (column 'vs base'), as "
                        "BACKEND or BACKEND:S; default: stock unsliced in the CPU and gpu-symm "
                        "worlds (torchrun, a GPU per rank), oneshot_wht6 unsliced in the "
                        "emulated and gpu-host worlds (tools/baseline.py)")
    p.add_argument("--timeline", action="store_true",
                   help="GPU worlds: record one op call's per-slice GEMM and AR events per "
                        "case (OUT_DIR/timeline.json, timeline_<backend>_M<M>_S<S>.png); "
                        "default off")
    p.add_argument("--probe-ctas", type=int_list, default="8,16,32,64",
                   help="GPU only: spinning-CTA counts K of the spin-footprint probe; "
                        "default %(default)s")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the spin-footprint probe; default off")
    args = p.parse_args(argv)
    if args.world < 1:
        p.error(f"--world {args.world}: expected >= 1")
    if args.out_dir is None:
        args.out_dir = "results"
        if os.path.realpath(args.out_dir) == os.path.realpath(TRACKED_RESULTS):
            p.error("the default ./results here is the tracked tools/results/ folder of "
                    "committed runs: pass --out-dir (run from the repository root, or name "
                    "a folder)")
    if args.producer not in producer_inputs.known():
        p.error(f"--producer {args.producer}: no weight format for it in "
                f"tools/producer_inputs.py (known: {', '.join(producer_inputs.known())})")
    if args.timeline and args.producer != "bf16":
        p.error(f"--timeline with --producer {args.producer}: tools/timeline.py records "
                "the bf16 producer only (it passes no weight scale)")
    args.plans = list(dict.fromkeys(x for x in args.plans.split(",") if x))
    if not args.plans:
        p.error(f"--plans: no plan named: expected some of {', '.join(OVERLAP_PLANS)}")
    for plan in args.plans:
        if plan not in OVERLAP_PLANS:
            p.error(f"--plans: {plan!r}: expected one of {', '.join(OVERLAP_PLANS)}")
    if args.baseline is not None:
        try:
            args.baseline = baseline.parse_arm(args.baseline)
        except ValueError as e:
            p.error(str(e))
    names = backends.names()
    args.backends = names if args.backends is None else [b for b in args.backends.split(",") if b]
    for b in args.backends:
        try:
            backends.get(b)
        except ValueError as e:
            p.error(f"--backends: {e}")
    return args
