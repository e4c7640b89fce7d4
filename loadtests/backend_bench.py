"""Raw ceiling of each SSH backend: sshpool driven directly (no HTTP) against a local sshd.

    .venv/bin/python -m loadtests.backend_bench                       # 3 backends, tuned sshd
    .venv/bin/python -m loadtests.backend_bench --backends ssh2 paramiko --profile stock -d 3

Per backend, in one run: the handshake time (TCP connect, key exchange, host key check and
public key auth of a fresh connection, done one after another), then one pool of four prewarmed
connections x 8 channels driven in a closed loop at 1, 8 and 32 concurrent commands (`true`,
through the pool's wrapper) for --duration seconds each. Reported: commands/s and p50/p99 per
command (HdrHistogram, 3 significant digits, successes only; errors counted apart).

Everything runs on this machine: sshd, its sessions and the client share the CPUs, so the figures
are a ceiling for this box, not for a remote login host. The login account's shell is /bin/sh
with no rc files (docs/operations.md: a heavy rc file adds to every command).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from loadtests import hdr
from sshpool import Pool, Target
from sshpool.backends import BACKENDS as REGISTRY
from sshpool.backends import load_backend
from sshpool.devhost import LocalHost, Rig, RigSpec, sshd_version

BACKENDS = list(REGISTRY)  # every backend the registry knows
DISTRIBUTIONS = {"asyncssh": "asyncssh", "paramiko": "paramiko", "ssh2": "ssh2-python"}
CONCURRENCY = [1, 8, 32]


@dataclass(frozen=True, slots=True)
class Row:
    backend: str
    what: str  # "handshake" or the concurrency
    rate: float | None  # per second
    p50_ms: float | None
    p99_ms: float | None
    count: int
    errors: int


async def handshakes(backend_name: str, target: Target, count: int) -> Row:
    """`count` fresh connections, one after another, each closed before the next."""
    backend = load_backend(backend_name)
    times: list[float] = []
    errors = 0
    for _ in range(count):
        started = time.perf_counter()
        try:
            conn = await backend.connect(target)
        except Exception:
            errors += 1
            continue
        times.append((time.perf_counter() - started) * 1000)
        await conn.close()
    stats = hdr.percentiles(hdr.histogram(times))
    return Row(backend_name, "handshake", None, stats["p50"], stats["p99"], len(times), errors)


async def closed_loop(
    pool: Pool, target: Target, concurrency: int, duration: float, argv: tuple[str, ...] = ("true",)
) -> Row:
    """`concurrency` callers, each running `argv` again as soon as its last one returned."""
    times: list[float] = []
    errors = 0
    end = time.perf_counter() + duration

    async def caller() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            started = time.perf_counter()
            try:
                await pool.run(target, list(argv), timeout=30)
            except Exception:
                errors += 1
                continue
            times.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    stats = hdr.percentiles(hdr.histogram(times))
    return Row(
        pool.backend.name,
        str(concurrency),
        len(times) / elapsed,
        stats["p50"],
        stats["p99"],
        len(times),
        errors,
    )


async def bench_backend(
    name: str, host: LocalHost, duration: float, handshake_count: int
) -> list[Row]:
    rows = [await handshakes(name, host.target(), handshake_count)]
    target = host.target(max_connections=4, min_connections=4, max_sessions=8)
    async with Pool(backend=name) as pool:
        await pool.prewarm(target)
        for concurrency in CONCURRENCY:
            # A short unmeasured run first, so every level starts from the same warm state.
            await closed_loop(pool, target, concurrency, min(1.0, duration / 5))
            rows.append(await closed_loop(pool, target, concurrency, duration))
    return rows


def library_version(backend: str) -> str:
    try:
        return version(DISTRIBUTIONS[backend])
    except PackageNotFoundError:
        return "not installed"


def table(rows: list[Row]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"{'backend':<10} {'concurrency':>11} {'commands/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'count':>6} {'errors':>6}"
    ]
    for r in rows:
        rate = "-" if r.rate is None else f"{r.rate:.0f}"
        lines.append(
            f"{r.backend:<10} {r.what:>11} {rate:>10} {ms(r.p50_ms):>8} {ms(r.p99_ms):>8} "
            f"{r.count:>6} {r.errors:>6}"
        )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="sshapi-bench-") as data_dir,
        Rig(RigSpec("backend-bench", args.profile), data_dir=data_dir) as rig,
    ):
        host = rig.host
        print(
            f"sshd {'.'.join(map(str, sshd_version()))} profile {args.profile} on "
            f"{host.address}:{host.port}, {os.cpu_count()} CPUs, {args.duration:g} s per "
            "level, pool 4 connections x 8 channels"
        )
        print(", ".join(f"{b} {library_version(b)}" for b in args.backends), flush=True)
        rows: list[Row] = []
        for name in args.backends:
            rows += await bench_backend(name, host, args.duration, args.handshakes)
        print(table(rows))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=BACKENDS)
    p.add_argument("--profile", choices=["stock", "tuned"], default="tuned", help="sshd profile")
    p.add_argument(
        "-d", "--duration", type=float, default=5.0, help="seconds per concurrency level"
    )
    p.add_argument("--handshakes", type=int, default=20, help="fresh connections timed")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
