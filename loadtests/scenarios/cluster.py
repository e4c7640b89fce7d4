"""Login-node faults under an open-model stream of commands (`loadtests.cluster`).

Four login nodes of the rig (as root, researcher accounts): steady, a node killed and back, a
node drained, a fourth node added; each phase's row.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import cluster
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("raw", "cluster", "faults", "root")
parse = cluster.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # the program builds its nodes beside its accounts' data directory


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    return {row["phase"]: row for row in cluster.faults(args)}
