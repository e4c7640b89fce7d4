"""Backend x sshd profile x pool mode x load profile, interleaved repeats (`loadtests.experiment`).

The comparison's rows and verdicts; every run's own report stays under
`reports/<time>-experiment/`.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import experiment
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "sshd", "matrix", "slow")
parse = experiment.parse


def rig(args: argparse.Namespace) -> RigSpec | None:
    return None  # a rig per sshd profile, built by the program


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    done = experiment.measure(args)
    return {"rows": done["rows"], "verdicts": done["verdicts"], "report": str(args.out)}
