"""Listings of big directories through the API (`loadtests.list_bench`).

Time, pages and the API's memory, with listings at once beside another identity's short jobs.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import list_bench
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "files", "memory")
parse = list_bench.parse


def rig(args: argparse.Namespace) -> RigSpec:
    return RigSpec("list-bench", "tuned")


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    assert rig is not None
    sizes = [int(s) for s in args.sizes.split(",")]
    return list_bench.measure(rig.host, rig.data_dir / "run", sizes, args.concurrent)
