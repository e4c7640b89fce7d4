"""The handshake ceiling: how many fresh SSH connections per second the rig's stock sshd
completes with k handshakes in flight, and the CPU each costs on either side.

    .venv/bin/python -m loadtests.handshakes --inflight 4 6 8 9 --duration 10

Per cell, k loops each: connect a researcher account (a fresh connection, key auth, through
the pool's backend), run `true` on it, close it; the accounts taken in turn. Reports the
handshakes completed per second, connects sshd dropped (MaxStartups) and its "drop connection"
lines, p50/p99 of a connect, and CPU per handshake: this process (the client), sshd (the
listener's reaped children: every connection's processes and what they ran), the whole box
(/proc/stat, other work included) and the load average. Run as root (the accounts are real).
This is the rate the per-sshd budget can reach at most (docs/pool.md, "One sshd, many
accounts").
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadtests import hdr
from sshpool import ConnectError, SSHPoolError, Target
from sshpool.backends import load_backend
from sshpool.command import Capture
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import ensure_accounts

TICK = os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its reaped children (sshd's listener reaps every connection's
    processes once they end)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICK


def drop_lines(host: LocalHost, offset: int) -> int:
    """sshd's "drop connection" lines (MaxStartups) in its log since `offset`."""
    with open(host.log_path, "rb") as f:
        f.seek(offset)
        return f.read().count(b"drop connection")


def box_busy() -> float:
    """CPU seconds the whole box was busy since boot (all cores, all processes)."""
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(cpu) - cpu[3] - cpu[4]) / TICK


async def cell(host: LocalHost, targets: list[Target], inflight: int, duration: float) -> Any:
    backend = load_backend("asyncssh")
    turn = itertools.cycle(targets)
    statuses: Counter[str] = Counter()
    hist = hdr.histogram()
    offset = host.log_path.stat().st_size
    assert host.pid is not None
    before = (own_cpu(), tree_cpu(host.pid), box_busy(), time.perf_counter())
    stop = before[3] + duration

    async def loop() -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                conn = await backend.connect(next(turn))
            except ConnectError as exc:
                statuses["dropped" if exc.retryable else type(exc).__name__] += 1
                continue
            except SSHPoolError as exc:
                statuses[type(exc).__name__] += 1
                continue
            hist.record_value(max(1, int((time.perf_counter() - t0) * 1e6)))
            try:
                await conn.exec("true", None, Capture(4096), Capture(4096))
                statuses["ok"] += 1
            except SSHPoolError as exc:
                statuses[type(exc).__name__] += 1
            finally:
                await conn.close()

    await asyncio.gather(*(loop() for _ in range(inflight)))
    elapsed = time.perf_counter() - before[3]
    await asyncio.sleep(1.0)  # let sshd reap the last connections' processes
    after = (own_cpu(), tree_cpu(host.pid), box_busy())
    ok = statuses["ok"] or 1
    p = hdr.percentiles(hist)
    return {
        "inflight": inflight,
        "seconds": round(elapsed, 1),
        "statuses": dict(statuses),
        "handshakes_per_s": round(statuses["ok"] / elapsed, 1),
        "connect_p50_ms": p["p50"],
        "connect_p99_ms": p["p99"],
        "drop_lines": drop_lines(host, offset),
        "client_cpu_ms": round((after[0] - before[0]) / ok * 1000, 2),
        "sshd_cpu_ms": round((after[1] - before[1]) / ok * 1000, 2),
        "box_cpu_ms": round((after[2] - before[2]) / ok * 1000, 2),
        "load": round(os.getloadavg()[0], 1),
    }


async def run(host: LocalHost, targets: list[Target], args: argparse.Namespace) -> list[Any]:
    rows = []
    for _ in range(args.rounds):
        for k in args.inflight:
            row = await cell(host, targets, k, args.duration)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.handshakes", description=__doc__)
    parser.add_argument("--inflight", type=int, nargs="+", default=[4, 6, 8, 9])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--data-dir", default=".data-accounts")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir).absolute()
    accounts = ensure_accounts(args.accounts, data_dir=data_dir)
    with LocalHost("accounts", "stock", data_dir=data_dir, researchers=True) as host:
        targets = [a.target(host) for a in accounts]
        rows = asyncio.run(run(host, targets, args))
    head = "inflight  hs/s  p50ms  p99ms drops client_ms sshd_ms box_ms load"
    print(head)
    for r in rows:
        print(
            f"{r['inflight']:8} {r['handshakes_per_s']:5} {r['connect_p50_ms']:6.1f} "
            f"{r['connect_p99_ms']:6.1f} {r['drop_lines']:5} {r['client_cpu_ms']:9} "
            f"{r['sshd_cpu_ms']:7} {r['box_cpu_ms']:6} {r['load']:4}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
