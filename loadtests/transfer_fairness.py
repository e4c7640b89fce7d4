"""Another identity's job latency while one identity downloads big files (issue 33, F10;
issue 41's transfer lane).

    python -m loadtests.transfer_fairness --size-mib 1024 --downloads 4 --lane on,off --rounds 2

It starts a local sshd (`tuned`) and the API (`loadtests.server.start_api`, pooled), makes a
sparse file of `--size-mib` on the host, then: `bob` submits `true` jobs one after the other
(`Prefer: wait=30`, 50 ms apart) for `--base-seconds` alone; then `alice` starts `--downloads`
downloads of the file at once (the bytes discarded; by `curl` processes, a client in C as scp
is, or with `--client httpx` in this process) while bob goes on until they end (at most
`--cap-seconds`); `--workers N` runs the API as N processes (`SSHAPI_WORKERS`). It prints
bob's p50/p90/max alone and during, the medians of his answers'
Server-Timing stages during (a `queue` near 0 means his commands never waited for a channel:
what is left is not queueing), the downloads' rate and the CPU seconds of the API process and
of sshd (with its session processes) during them. `--lane on,off` runs it once per API
configuration (`[api] transfer_lane`), interleaved over `--rounds`; each round ends with
`--downloads` parallel `scp` of the same file over the same sshd (OpenSSH's figure beside the
API's, in the same run), bob's jobs running through an API beside them as beside the API's
downloads: his ratio during the scp is what the box itself leaves him while that many bytes
move (sshd's ciphers and the copies on the same cores). Bounded: one file, N downloads, one cap
per run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
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


async def curl_download(url: str, token: str, path: str) -> int:
    """One download by `curl` to /dev/null: a client in C, as scp is, so that the figure beside
    scp's is the API's and not this process's Python reading four streams."""
    argv = [
        "curl", "--silent", "--show-error", "--fail", "--output", "/dev/null",
        "--write-out", "%{size_download}", "--header", "@-", "--get",
        "--data-urlencode", f"path={path}", f"{url}/v1/hosts/local/files/content",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await proc.communicate(f"Authorization: Bearer {token}\n".encode())
    if proc.returncode != 0:
        raise RuntimeError(f"curl failed ({proc.returncode}): {err.decode()[:200]}")
    return int(out)


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
    url: str,
    tokens: tuple[str, str],
    path: str,
    args: argparse.Namespace,
    pids: tuple[int, int],
    scp: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Bob alone, then bob while alice downloads through the API, or, with `scp`, while
    `scp()` runs (OpenSSH moving the same bytes: what the box itself leaves bob)."""
    alice, bob = tokens
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=32)) as client:
        with Bystander(url, bob, every=0.05, wait=30) as alone:
            await asyncio.sleep(args.base_seconds)
        with Bystander(url, bob, every=0.05, wait=30) as during:
            api0, sshd0, t0 = cpu_seconds(pids[0]), cpu_seconds(pids[1]), time.perf_counter()
            if scp is not None:
                copied = await asyncio.wait_for(asyncio.to_thread(scp), args.cap_seconds)
                received = [copied["bytes"]]
            else:
                downloads = [
                    curl_download(url, alice, path)
                    if args.client == "curl"
                    else download(client, url, alice, path)
                    for _ in range(args.downloads)
                ]
                received = await asyncio.wait_for(asyncio.gather(*downloads), args.cap_seconds)
            wall = time.perf_counter() - t0
            api_cpu, sshd_cpu = cpu_seconds(pids[0]) - api0, cpu_seconds(pids[1]) - sshd0
    return {
        **(copied if scp is not None else {}),
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
    if "runs" in result:
        return "\n".join(_report_many(result))
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


def _report_many(result: dict[str, Any]) -> list[str]:
    lines = []
    for run in result["runs"]:
        if run["kind"] == "scp":
            alone, during = run["alone_ms"], run["during_ms"]
            lines.append(
                f"round {run['round']}: {run['downloads']} parallel scp: {run['mb_per_s']:.0f} "
                f"MB/s ({run['mib_per_s']:.0f} MiB/s) in {run['seconds']:.1f} s; bob p50 alone "
                f"{pct(alone, 0.5):.1f} ms, during the scp {pct(during, 0.5):.1f} ms "
                f"(x{pct(during, 0.5) / pct(alone, 0.5):.2f}: what the box leaves him); failed "
                f"{run['failed']}; load {run['load']:.1f}"
            )
            continue
        alone, during = run["alone_ms"], run["during_ms"]
        ratio = pct(during, 0.5) / pct(alone, 0.5)
        mb = run["downloaded_mb"] / run["seconds"]
        lines.append(
            f"round {run['round']}, lane {run['lane']}: bob p50 alone {pct(alone, 0.5):.1f} ms, "
            f"during {pct(during, 0.5):.1f} ms (x{ratio:.2f}; target <= 2.5), p90 "
            f"{pct(during, 0.9):.1f}, max {max(during):.0f}; downloads {mb:.0f} MB/s "
            f"({mb * 1e6 / MIB:.0f} MiB/s, {mb / run['scp_mb_per_s']:.0%} of scp's in this round);"
            f" CPU API {run['api_cpu_s']:.1f} s, sshd {run['sshd_cpu_s']:.1f} s; stages "
            f"{run['stages_during_ms']}; failed {run['failed']}; load {run['load']:.1f}"
        )
    return lines


def scp_downloads(host: Any, path: str, n: int) -> dict[str, Any]:
    """`n` scp of `path` at once to /dev/null, over the host's sshd with its key."""
    from loadtests.files_bench import scp_argv

    ssh_argv = host.ssh_argv()
    argv = [*scp_argv(ssh_argv), f"{ssh_argv[-1]}:{path}", "/dev/null"]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(argv) for _ in range(n)]
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"scp failed: {proc.returncode}")
    seconds = time.perf_counter() - t0
    size = os.path.getsize(path) * n
    return {
        "kind": "scp",
        "downloads": n,
        "bytes": size,
        "seconds": seconds,
        "mb_per_s": size / seconds / 1e6,
        "mib_per_s": size / seconds / MIB,
        "load": os.getloadavg()[0],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.transfer_fairness")
    ap.add_argument("--size-mib", type=int, default=1024, help="size of the file downloaded")
    ap.add_argument("--downloads", type=int, default=4, help="downloads at once (alice)")
    ap.add_argument("--base-seconds", type=float, default=8.0, help="bob alone, first")
    ap.add_argument("--cap-seconds", type=float, default=150.0, help="the downloads' limit")
    ap.add_argument(
        "--lane",
        default="",
        help="on,off: one run per [api] transfer_lane setting, interleaved, with scp's figure",
    )
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the --lane runs")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="the API's processes (SSHAPI_WORKERS): each with its own lane and interpreter",
    )
    ap.add_argument(
        "--client",
        default="curl",
        choices=["curl", "httpx"],
        help="alice's downloads by curl processes (as scp's) or by httpx in this process",
    )
    return ap.parse_args(argv)


def measure(host: Any, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run the measurement against the started LocalHost `host`."""
    path = os.path.join(host.account.home, f"fairness-{os.getpid()}.bin")
    host.run_local(["truncate", "-s", str(args.size_mib * MIB), path])
    try:
        if not args.lane:
            return _measure_one(host, args, workdir, path, None)
        runs: list[dict[str, Any]] = []
        for n in range(args.rounds):
            these = []
            for lane in args.lane.split(","):
                run = _measure_one(host, args, workdir / f"{n}-{lane}", path, lane == "on")
                these.append({**run, "kind": "api", "lane": lane, "round": n + 1})
            scp = _measure_one(host, args, workdir / f"{n}-scp", path, None, scp=True)
            scp = {**scp, "round": n + 1}
            for run in these:
                run["scp_mb_per_s"] = scp["mb_per_s"]
            runs += [*these, scp]
        return {"runs": runs}
    finally:
        host.run_local(["rm", "-f", path])


def _measure_one(
    host: Any,
    args: argparse.Namespace,
    workdir: Path,
    path: str,
    lane: bool | None,
    *,
    scp: bool = False,
) -> dict[str, Any]:
    from api.local import local_token, resolve_config
    from api.settings import Settings

    api_dir = workdir / "api"
    options = None if lane is None else {"transfer_lane": lane}
    proc, url = start_api(
        host,
        backend="asyncssh",
        pool_mode="pooled",
        data_dir=api_dir,
        api=options,
        env={"SSHAPI_WORKERS": str(args.workers)},
    )
    try:
        settings = Settings(data_dir=api_dir)
        config = resolve_config(settings)
        alice = local_token(settings, config, "alice", ["files:read"])
        bob = local_token(settings, config, "bob", ["jobs:read", "jobs:write"])
        copy = (lambda: scp_downloads(host, path, args.downloads)) if scp else None
        return asyncio.run(run(url, (alice, bob), path, args, (proc.pid, host.pid), copy))
    finally:
        stop_api(proc)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tuned_host("fairness") as (host, tmp):
        result = measure(host, args, tmp)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
