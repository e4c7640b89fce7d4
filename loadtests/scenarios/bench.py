"""The API against the raw SSH ceiling and per-request connections (`loadtests.bench`).

Raw pool, API sweep, per-request sweep, a burst, the CPU row and many accounts, per sshd profile;
its Locust runs stay under `reports/<time>-bench/`. Each profile's host is a rig of its own.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import bench
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "raw", "cpu", "slow")
parse = bench.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # a rig per sshd profile, built by the program


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    figures = bench.measure(args)
    # {"stock auto": {...}, "stock agent": {...}, "stock": {...} (channel)}: one entry per
    # profile and exec mode
    return {bench.label(f): f for f in figures} | {"report": str(args.out)}
