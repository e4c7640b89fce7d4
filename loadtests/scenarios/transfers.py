"""Transfers through the API beside OpenSSH's scp, loopback and through the relay (issue 41).

`loadtests.files_bench` for each backend and each round trip (the API, the backend's SFTP
alone and scp moving the same file in the same run), then `loadtests.transfer_fairness`
with the transfer lane on and off (another identity's jobs during 4 downloads, and 4
parallel scp of the same file).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from loadtests import files_bench, transfer_fairness
from sshpool.devhost.rig import Rig, RigSpec

TAGS = ("http", "files", "wan", "fairness")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests run transfers")
    p.add_argument("--size-mib", type=int, default=1024, help="the file moved each way")
    p.add_argument("--backends", default="asyncssh,paramiko,ssh2")
    p.add_argument("--rtts", default="0,20", help="round trips (ms) of the relay; 0: loopback")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--fairness-size-mib", type=int, default=1024)
    p.add_argument("--downloads", type=int, default=4)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def rig(args: argparse.Namespace) -> RigSpec:
    return RigSpec("transfers", "tuned")


def run(rig: Rig | None, args: argparse.Namespace) -> dict[str, Any]:
    assert rig is not None
    size = args.size_mib * files_bench.MIB
    bench: list[dict[str, Any]] = []
    for rtt in (float(x) for x in args.rtts.split(",")):
        for backend in args.backends.split(","):
            work = rig.data_dir / f"transfers-{backend}-{rtt:g}"
            result = files_bench.measure(rig.host, size, work, backend, args.rounds, rtt)
            print(files_bench.report(result), flush=True)
            bench.append(result)
    fairness_args = transfer_fairness.parse(
        [
            "--size-mib",
            str(args.fairness_size_mib),
            "--downloads",
            str(args.downloads),
            "--lane",
            "on,off",
            "--rounds",
            str(args.rounds),
        ]
    )
    fairness = transfer_fairness.measure(rig.host, fairness_args, rig.data_dir / "fairness")
    print(transfer_fairness.report(fairness), flush=True)
    return {"files_bench": bench, "fairness": fairness, "load": os.getloadavg()}
