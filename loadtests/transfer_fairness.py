"""Another identity's job latency while one identity downloads big files (issue 33, F10).

    python -m loadtests.transfer_fairness --size-mib 1024 --downloads 4

It starts a local sshd (`tuned`) and the API (`loadtests.server.start_api`, pooled), makes a
sparse file of `--size-mib` on the host, then: `bob` submits `true` jobs one after the other
(`Prefer: wait=30`, 50 ms apart) for `--base-seconds` alone; then `alice` starts `--downloads`
downloads of the file at once (the bytes discarded) while bob goes on until they end (at most
`--cap-seconds`). It prints bob's p50/p90/max alone and during, the medians of his answers'
Server-Timing stages during (a `queue` near 0 means his commands never waited for a channel:
what is left is not queueing), the downloads' rate and the CPU seconds of the API process and
of sshd (with its session processes) during them. Bounded: one file, N downloads, one cap.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from loadtests.bystander import Bystander
from loadtests.server import start_api, stop_api, tuned_host

MIB = 1 << 20


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its descendants (those that can still be read)."""
    total = 0.0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def download(client: httpx.AsyncClient, url: str, token: str, path: str) -> int:
    received = 0
    async with client.stream(
        "GET",
        f"{url}/v1/hosts/local/files/content",
        params={"path": path},
        headers={"Authorization": f"Bearer {token}"},
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"download answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for chunk in r.aiter_raw(MIB):
            received += len(chunk)
    return received


async def run(
    url: str, tokens: tuple[str, str], path: str, args: argparse.Namespace, pids: tuple[int, int]
) -> dict[str, Any]:
    alice, bob = tokens
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=32)) as client:
        with Bystander(url, bob, every=0.05, wait=30) as alone:
            await asyncio.sleep(args.base_seconds)
        with Bystander(url, bob, every=0.05, wait=30) as during:
            api0, sshd0, t0 = cpu_seconds(pids[0]), cpu_seconds(pids[1]), time.perf_counter()
            received = await asyncio.wait_for(
                asyncio.gather(
                    *(download(client, url, alice, path) for _ in range(args.downloads))
                ),
                args.cap_seconds,
            )
            wall = time.perf_counter() - t0
            api_cpu, sshd_cpu = cpu_seconds(pids[0]) - api0, cpu_seconds(pids[1]) - sshd0
    return {
        "alone_ms": alone.ms,
        "during_ms": during.ms,
        "failed": alone.failed + during.failed,
        "stages_during_ms": during.stages(),
        "downloaded_mb": sum(received) / 1e6,
        "seconds": wall,
        "api_cpu_s": api_cpu,
        "sshd_cpu_s": sshd_cpu,
        "load": os.getloadavg()[0],
    }


def report(result: dict[str, Any]) -> str:
    alone, during = result["alone_ms"], result["during_ms"]
    mb, seconds = result["downloaded_mb"], result["seconds"]
    return "\n".join(
        [
            f"bob alone: {len(alone)} jobs, p50 {pct(alone, 0.5):.1f} ms, "
            f"p90 {pct(alone, 0.9):.1f} ms",
            f"bob during the downloads: {len(during)} jobs, p50 {pct(during, 0.5):.1f} ms, "
            f"p90 {pct(during, 0.9):.1f} ms, max {max(during):.0f} ms",
            f"Server-Timing medians during (ms): {result['stages_during_ms']}; bob's jobs that "
            f"failed: {result['failed']}",
            f"downloads: {mb:.0f} MB in {seconds:.1f} s ({mb / seconds:.0f} MB/s); CPU: API "
            f"{result['api_cpu_s']:.1f} s, sshd {result['sshd_cpu_s']:.1f} s; "
            f"load {result['load']:.1f}",
        ]
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.transfer_fairness")
    ap.add_argument("--size-mib", type=int, default=1024, help="size of the file downloaded")
    ap.add_argument("--downloads", type=int, default=4, help="downloads at once (alice)")
    ap.add_argument("--base-seconds", type=float, default=8.0, help="bob alone, first")
    ap.add_argument("--cap-seconds", type=float, default=150.0, help="the downloads' limit")
    return ap.parse_args(argv)


def measure(host: Any, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run the measurement against the started LocalHost `host`."""
    from api.local import local_token, resolve_config
    from api.settings import Settings

    path = os.path.join(host.account.home, f"fairness-{os.getpid()}.bin")
    host.run_local(["truncate", "-s", str(args.size_mib * MIB), path])
    api_dir = workdir / "api"
    proc, url = start_api(host, backend="asyncssh", pool_mode="pooled", data_dir=api_dir)
    try:
        settings = Settings(data_dir=api_dir)
        config = resolve_config(settings)
        alice = local_token(settings, config, "alice", ["files:read"])
        bob = local_token(settings, config, "bob", ["jobs:read", "jobs:write"])
        return asyncio.run(run(url, (alice, bob), path, args, (proc.pid, host.pid)))
    finally:
        stop_api(proc)
        host.run_local(["rm", "-f", path])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tuned_host("fairness") as (host, tmp):
        result = measure(host, args, tmp)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
