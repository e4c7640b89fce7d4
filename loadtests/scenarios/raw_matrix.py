"""sshpool alone against sshd profile x pool limits, interleaved (`loadtests.raw_matrix`).

Each cell's rate, p50 and p99 per round, by callers, sshd profile and limits.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from loadtests import raw_matrix
from loadtests.report import run_dir
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("raw", "ssh", "sshd")
parse = raw_matrix.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # a rig per sshd profile, built by the program


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    args.out = run_dir(args.out, "raw-matrix")  # its hosts' files, as the program keeps them
    results = asyncio.run(raw_matrix.cells(args))
    # {"8 callers": {"stock": {"default": [{"rate": ..., "p50_ms": ...}, ...]}}}
    out: dict[str, Any] = {}
    for (callers, sshd, limits), rows in sorted(results.items()):
        out.setdefault(f"{callers} callers", {}).setdefault(sshd, {})[limits] = rows
    return out
