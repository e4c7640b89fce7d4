"""API replicas on one PostgreSQL schema behind nginx, a sustained load each (`loadtests.replicas`).

One row per load stage and replica count, in the order given: offered and achieved rate, p50 and
p99 of the successes, errors, whether the run was valid.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import replicas
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "replicas", "nginx", "slow")
parse = replicas.parse


def rig(args: argparse.Namespace) -> RigSpec:
    return RigSpec("replicas", "tuned")


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    assert rig is not None
    return {"stages": replicas.measure_all(args, rig.host, rig.data_dir / "replicas")}
