"""Many researcher accounts on one stock sshd, one job each at once (`loadtests.accounts`).

Each cell's makespan, failures, sshd drop lines, connections at the peak and sshd memory; with
`--via api` through `sshapi serve` (`--workers`, `--replicas`, `--fault redis|worker|replica`).
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import accounts
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("raw", "http", "accounts", "budget", "root")
parse = accounts.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # the program builds its host beside its accounts' data directory


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    return {"cells": accounts.measure(args)}
