"""The raw ceiling of each SSH library, no HTTP (`loadtests.backend_bench`).

Handshakes, then a prewarmed pool in a closed loop at 1, 8 and 32 callers, against the rig's host.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any

from loadtests import backend_bench
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("raw", "ssh", "quick")
parse = backend_bench.parse


def rig(args: argparse.Namespace) -> RigSpec:
    return RigSpec("backend-bench", args.profile)


def _figures(row: backend_bench.Row) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(row).items() if k not in ("backend", "what")}


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    assert rig is not None
    out: dict[str, Any] = {}
    for name in args.backends:
        bench = backend_bench.bench_backend(name, rig.host, args.duration, args.handshakes)
        rows = asyncio.run(bench)
        # {"asyncssh": {"handshake": {"rate": ..., "p50_ms": ...}, "8": {...}}}
        out[name] = {r.what: _figures(r) for r in rows}
    return out
