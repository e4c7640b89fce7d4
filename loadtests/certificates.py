"""Researchers as themselves, measured: N researcher accounts (the rig's `sshapi-r0001`...,
real Unix accounts) on the rig's stock sshd run as root, each logged in with a fresh
certificate of the rig's user CA per connection.

    .venv/bin/python -m loadtests.certificates --accounts 200

(a) burst: one `id -un` per account, all released at once, then again on the same pool:
    statuses, p50/p99, how many answered another account than their own, and sshd's
    "Refusing certificate" lines;
(b) connect: --connects fresh logins one after another of the host's account, with its key
    file and with a certificate: median and p90 ms (the certificate adds its minting and a
    longer signature check);
(c) CPU per job on a warm connection: --jobs `true` one after another, key file vs
    certificate, this process's CPU seconds per job (the certificate costs only at connect).

Measured at the pool (the API adds the same per job either way). Run as root (the accounts are
real). Prints one JSON object per part and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadtests import hdr
from loadtests.server import limits
from sshpool import Pool, SSHPoolError, Target
from sshpool.backends import load_backend
from sshpool.devhost import LocalHost
from sshpool.devhost.accounts import ensure_accounts


async def whoami(pool: Pool, target: Target, deadline: float) -> tuple[str, float]:
    send = time.perf_counter()
    try:
        result = await pool.run(target, ["id", "-un"], timeout=30, acquire_timeout=deadline)
        status = "ok" if result.stdout.decode().strip() == target.username else "wrong-account"
    except SSHPoolError as exc:
        status = type(exc).__name__
    return status, (time.perf_counter() - send) * 1000.0


def log_since(host: LocalHost, offset: int) -> bytes:
    with open(host.log_path, "rb") as f:
        f.seek(offset)
        return f.read()


async def burst(host: LocalHost, names: list[str], rounds: int, deadline: float) -> list[Any]:
    base = limits("pooled")
    targets = [
        dataclasses.replace(host.certificate_target(f"researcher-{i}", username=name), limits=base)
        for i, name in enumerate(names)
    ]
    rows = []
    async with Pool() as pool:
        for round_ in range(rounds):
            offset = host.log_path.stat().st_size
            t0 = time.perf_counter()
            done = await asyncio.gather(*(whoami(pool, t, deadline) for t in targets))
            makespan = time.perf_counter() - t0
            log = log_since(host, offset)
            pct = hdr.percentiles(hdr.histogram(ms for _, ms in done))
            rows.append(
                {
                    "part": "burst",
                    "round": round_ + 1,
                    "accounts": len(targets),
                    "statuses": dict(Counter(s for s, _ in done)),
                    "p50_ms": pct["p50"],
                    "p99_ms": pct["p99"],
                    "makespan_s": round(makespan, 2),
                    "certificate_logins": log.count(b"ED25519-CERT"),
                    "refusing_certificate_lines": log.count(b"Refusing certificate"),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


async def connects(host: LocalHost, n: int) -> dict[str, Any]:
    """Fresh logins one after another, interleaved key / certificate."""
    backend = load_backend("asyncssh")
    kinds = {"key": host.target(), "certificate": host.certificate_target("bench")}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(n):
        for kind, target in kinds.items():
            t0 = time.perf_counter()
            conn = await backend.connect(target)
            times[kind].append((time.perf_counter() - t0) * 1000.0)
            await conn.close()
    row: dict[str, Any] = {"part": "connect", "connects": n}
    for kind, values in times.items():
        row[f"{kind}_p50_ms"] = round(statistics.median(values), 2)
        row[f"{kind}_p90_ms"] = round(statistics.quantiles(values, n=10)[-1], 2)
    print(json.dumps(row), flush=True)
    return row


async def cpu_per_job(host: LocalHost, jobs: int, rounds: int) -> dict[str, Any]:
    """This process's CPU per `true` on a warm connection, interleaved rounds."""
    kinds = {"key": host.target(), "certificate": host.certificate_target("bench-cpu")}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    async with Pool() as pool:
        for target in kinds.values():
            await pool.run(target, ["true"], timeout=30)  # warm: the connection is made
        for _ in range(rounds):
            for kind, target in kinds.items():
                c0 = time.process_time()
                for _ in range(jobs):
                    await pool.run(target, ["true"], timeout=30)
                cpu[kind].append((time.process_time() - c0) / jobs * 1000.0)
    row: dict[str, Any] = {"part": "cpu", "jobs": jobs, "rounds": rounds}
    for kind, values in cpu.items():
        row[f"{kind}_cpu_ms_per_job"] = round(statistics.median(values), 3)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.certificates", description=__doc__)
    parser.add_argument("--accounts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="bursts, and CPU rounds")
    parser.add_argument("--connects", type=int, default=30, help="fresh logins per kind")
    parser.add_argument("--jobs", type=int, default=300, help="jobs per CPU round")
    parser.add_argument("--deadline", type=float, default=60.0, help="acquire timeout, s")
    parser.add_argument("--data-dir", default=".data-certificates")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir).absolute()
    names = [a.name for a in ensure_accounts(args.accounts, data_dir=data_dir)]
    with LocalHost("certificates", "stock", data_dir=data_dir, researchers=True) as host:
        rows = asyncio.run(burst(host, names, args.rounds, args.deadline))
        rows.append(asyncio.run(connects(host, args.connects)))
        rows.append(asyncio.run(cpu_per_job(host, args.jobs, args.rounds)))
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
