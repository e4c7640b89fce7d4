"""How long the `sshapi` command takes to start, beside `python -c pass` (`loadtests.cli_startup`).

Each command's median, p90 and minimum wall time and median CPU, in ms, against a scratch
`sshapi dev`.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import cli_startup
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("client", "startup")
parse = cli_startup.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # `sshapi dev` builds its own


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    return {name: cli_startup.stats(times) for name, times in cli_startup.measure(args).items()}
