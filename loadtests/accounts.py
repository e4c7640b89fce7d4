"""One sshd, many accounts: N researcher accounts (the rig's `sshapi-r0001`..., real Unix
accounts, each with its own key) on the rig's stock sshd, run as root as a site's is; the pool
with its per-sshd budget against per-account limits (`Limits(per_sshd=False)`: the behaviour
before it), interleaved in one run.

    .venv/bin/python -m loadtests.accounts --accounts 200 --rounds 2
    .venv/bin/python -m loadtests.accounts --accounts 1000 --rate 50 --duration 300

Per mode and round, on a fresh pool (the API's limits, `loadtests.server.limits`):
(a) burst: one `true` per account, all released at once (acquire timeout --deadline): statuses,
    p50/p90/p99 and makespan;
(b) rate (--rate > 0): an open-model stream of --rate commands/s for --duration s, each from a
    random account, so most find their account's connection closed for another's.
Each reports the statuses, latency, handshakes made, evictions, connections held at most, the
sshd log's "drop connection" lines (MaxStartups), and sshd's processes and their memory (RSS)
after the burst. Run as root (the accounts are real). Measured at the pool, without HTTP: the
API adds the same per job on every mode. Prints one JSON object per cell and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadtests import hdr
from loadtests.server import limits
from sshpool import Pool, SSHPoolError, Target
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import Account, ensure_accounts
from sshpool.devhost.procs import children

MODES = ("budget", "per-account")


def sshd_memory(host: LocalHost) -> tuple[int, int]:
    """(processes, RSS in MiB) of sshd's per-connection processes and what they run."""
    if host.pid is None:
        return 0, 0
    total = 0
    found = children(host.pid)
    for pid in found:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return len(found), total // 1024


def drops(host: LocalHost, offset: int) -> int:
    with open(host.log_path, "rb") as f:
        f.seek(offset)
        return f.read().count(b"drop connection")


async def one(pool: Pool, target: Target, deadline: float, send: float) -> tuple[str, float]:
    try:
        result = await pool.run(target, ["true"], timeout=30, acquire_timeout=deadline)
        status = "ok" if result.ok else f"exit {result.exit_status}"
    except SSHPoolError as exc:
        status = type(exc).__name__
    return status, (time.perf_counter() - send) * 1000.0


async def cell(
    host: LocalHost, targets: list[Target], part: str, args: argparse.Namespace
) -> dict[str, Any]:
    offset = host.log_path.stat().st_size
    statuses: Counter[str] = Counter()
    hist = hdr.histogram()
    t0 = time.perf_counter()
    memory = (0, 0)
    max_held = 0
    async with Pool() as pool:

        async def sample() -> None:
            nonlocal max_held
            while True:
                max_held = max(max_held, _held(pool))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())

        def record(outcome: tuple[str, float]) -> None:
            statuses[outcome[0]] += 1
            hist.record_value(max(1, int(outcome[1] * 1000)))

        if part == "burst":
            now = time.perf_counter()
            for outcome in await asyncio.gather(
                *(one(pool, t, args.deadline, now) for t in targets)
            ):
                record(outcome)
            makespan = time.perf_counter() - t0
            memory = sshd_memory(host)
        else:
            tasks = []
            n = int(args.rate * args.duration)
            for i in range(n):
                send = t0 + i / args.rate
                await asyncio.sleep(max(0.0, send - time.perf_counter()))
                task = asyncio.create_task(one(pool, random.choice(targets), args.deadline, send))
                task.add_done_callback(lambda t: record(t.result()))
                tasks.append(task)
            await asyncio.gather(*tasks)
            makespan = time.perf_counter() - t0
            memory = sshd_memory(host)
        sampler.cancel()
        stats = pool.stats()
        # Per-account targets have an sshd budget each: the sampled total counts for them.
        sshds = pool.sshd_stats() if len(pool.sshd_stats()) == 1 else {}
        max_held = max([max_held, *(s["connections_max"] for s in sshds.values())])
        counters: Counter[str] = Counter()
        for s in stats.values():
            counters.update(s["counters"])
    p = hdr.percentiles(hist)
    return {
        "part": part,
        "accounts": len(targets),
        "statuses": dict(statuses),
        "failed": sum(v for k, v in statuses.items() if k != "ok"),
        "p50_ms": p["p50"],
        "p90_ms": p["p90"],
        "p99_ms": p["p99"],
        "makespan_s": round(makespan, 2),
        "handshakes": counters["connects"] + counters["connects_failed"],
        "handshakes_per_s": round((counters["connects"]) / makespan, 1),
        "connect_retries": counters["connect_retries"],
        "evictions": counters["evicted"],
        "connections_max": max_held,
        "sshd_drop_lines": drops(host, offset),
        "sshd_processes": memory[0],
        "sshd_rss_mib": memory[1],
    }


def _held(pool: Pool) -> int:
    return sum(s["connections"] for s in pool.stats().values())


async def run_cells(
    host: LocalHost, accounts: list[Account], args: argparse.Namespace
) -> list[dict[str, Any]]:
    base = limits("pooled")
    per_mode = {mode: dataclasses.replace(base, per_sshd=mode == "budget") for mode in MODES}
    rows = []
    parts = ["burst"] + (["rate"] if args.rate > 0 else [])
    for round_ in range(args.rounds):
        # Interleaved, the order flipped every round: neither mode always runs first.
        modes = MODES if round_ % 2 == 0 else MODES[::-1]
        for part in parts:
            for mode in modes:
                targets = [
                    dataclasses.replace(a.target(host), limits=per_mode[mode]) for a in accounts
                ]
                figures = await cell(host, targets, part, args)
                row = {"mode": mode, "round": round_ + 1, **figures}
                print(json.dumps(row), flush=True)
                rows.append(row)
                await asyncio.sleep(args.pause)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "mode         round part  accts failed  p50ms  p90ms  p99ms  make_s  hs/s evict "
        "conn_max drops procs rss_MiB"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['mode']:12} {r['round']:5} {r['part']:5} {r['accounts']:5} {r['failed']:6} "
            f"{r['p50_ms'] or 0:6.0f} {r['p90_ms'] or 0:6.0f} {r['p99_ms'] or 0:6.0f} "
            f"{r['makespan_s']:7.2f} {r['handshakes_per_s']:5} {r['evictions']:5} "
            f"{r['connections_max']:8} {r['sshd_drop_lines']:5} {r['sshd_processes']:5} "
            f"{r['sshd_rss_mib']:7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.accounts", description=__doc__)
    parser.add_argument("--accounts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1, help="A/B rounds, interleaved")
    parser.add_argument("--rate", type=float, default=0.0, help="commands/s of part (b); 0: none")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of part (b)")
    parser.add_argument("--deadline", type=float, default=30.0, help="acquire timeout, s")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between cells")
    parser.add_argument("--data-dir", default=".data-accounts")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir).absolute()
    accounts = ensure_accounts(args.accounts, data_dir=data_dir)
    with LocalHost("accounts", "stock", data_dir=data_dir, researchers=True) as host:
        rows = asyncio.run(run_cells(host, accounts, args))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
