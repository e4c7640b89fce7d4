"""A steady open-model load for minutes, memory and counts watched (`loadtests.soak`).

The verdict (growth of each watched quantity) and the requests; the samples stay in its own
`soak.json`.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import soak
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "memory", "slow")
parse = soak.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # the program builds its host beside its report


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    doc = soak.measure(args)
    return {k: doc[k] for k in ("requests", "verdict", "ok", "locust_exit", "report")}
