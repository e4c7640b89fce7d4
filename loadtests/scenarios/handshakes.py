"""Fresh SSH connections per second with k handshakes in flight (`loadtests.handshakes`).

The handshake ceiling of the rig's stock sshd and the CPU each handshake costs on either side;
as root (it logs in the researcher accounts it makes).
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import handshakes
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("raw", "ssh", "sshd", "root")
parse = handshakes.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # the program builds its host beside its accounts' data directory


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    # {"4 in flight": {"exec": {"asyncssh": {"default": [{"handshakes_per_s": ...}]}}}}: a row
    # per round
    out: dict[str, Any] = {}
    for row in handshakes.measure(args):
        cell = out.setdefault(f"{row['inflight']} in flight", {}).setdefault(row["phase"], {})
        cell.setdefault(row["client"], {}).setdefault(row["kex"], []).append(row)
    return out
