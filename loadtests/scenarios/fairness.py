"""Short jobs of one identity while another downloads (`loadtests.transfer_fairness`).

The short jobs' latency alone and during the downloads, and the downloads' rate.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import transfer_fairness
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "files", "fairness")
parse = transfer_fairness.parse


def rig(args: argparse.Namespace) -> RigSpec:
    return RigSpec("fairness", "tuned")


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    assert rig is not None
    return transfer_fairness.measure(rig.host, args, rig.data_dir)
