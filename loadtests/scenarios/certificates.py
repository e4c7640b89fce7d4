"""Researchers as themselves, each login with a fresh certificate (`loadtests.certificates`).

Bursts of one job per researcher account, fresh logins by key and by certificate, and CPU per
job, on the rig's stock sshd as root; `--http` through `sshapi serve`.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import certificates
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("raw", "http", "accounts", "certificates", "root")
parse = certificates.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # the program builds its host beside its accounts' data directory


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    # {"burst": [{"round": 1, ...}, ...], "connect": [{...}], "cpu": [{...}]}
    out: dict[str, Any] = {}
    for row in certificates.measure(args):
        out.setdefault(row["part"], []).append(row)
    return out
