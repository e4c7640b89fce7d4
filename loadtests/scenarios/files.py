"""File transfers through the API beside scp and SFTP (`loadtests.files_bench`).

The API's memory and CPU watched, against the rig's tuned host.
"""

from __future__ import annotations

import argparse
from typing import Any

from loadtests import files_bench
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "files", "memory")
parse = files_bench.parse


def rig(args: argparse.Namespace) -> RigSpec:
    return RigSpec("files-bench", "tuned")


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    assert rig is not None
    work = (args.out or rig.data_dir) / "run"
    size = args.size_mib * files_bench.MIB
    return files_bench.measure(rig.host, size, work, args.backend, args.rounds)
