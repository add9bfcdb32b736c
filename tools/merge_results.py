#!/usr/bin/env python3
"""Merge compare_backends JSON files of one world into one table, JSON, CSV and PNG.

    python tools/merge_results.py OUT_DIR run1/compare.json run2/compare.json ...

Useful when backends were run as separate processes (e.g. one per backend, each under its
own timeout on a lent GPU). The mode header of the first file is kept (its spin_footprint
replaced by the last file's that has one), with every file's command listed; files from
different worlds or W are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


import report  # noqa: E402
from compare_backends import baseline_of  # noqa: E402


def merge(paths: list[str]) -> tuple[dict, list[dict]]:
    header, records, commands = None, [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        mode = data["mode"]
        if header is None:
            header = dict(mode)
        elif (mode["world"], mode["W"], mode["device"]) != (header["world"], header["W"], header["device"]):
            raise ValueError(f"{path}: world {mode['world']} W={mode['W']} on {mode['device']} "
                             f"differs from {header['world']} W={header['W']} on {header['device']}")
        if "spin_footprint" in mode:
            header["spin_footprint"] = mode["spin_footprint"]
        commands.append(mode["command"])
        records += data["records"]
    header["command"] = " ; ".join(commands)
    return header, records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder for compare.json/.csv/.png")
    p.add_argument("inputs", nargs="+", help="compare.json files to merge")
    args = p.parse_args(argv)
    header, records = merge(args.inputs)
    os.makedirs(args.out_dir, exist_ok=True)
    report.write_json(os.path.join(args.out_dir, "compare.json"), header, records)
    report.write_csv(os.path.join(args.out_dir, "compare.csv"), records)
    report.write_png(os.path.join(args.out_dir, "compare.png"),
                     f"{header['label']} -- {header['device']} -- {header['date'][:10]}", records,
                     baseline_of(header), header.get("vs_base"))
    print(report.table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
