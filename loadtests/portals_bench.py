"""Following 1,000 running jobs: one change feed against polling each job every 2 s (issue 43).

    python -m loadtests.portals_bench --jobs 1000 --phase 30 --rounds 2

It starts a local sshd (`tuned`) and the API (`loadtests.server.serve_config`: SQLite, agent mode,
8 connections of 128 commands each, so that 1,000 `sleep` commands run at once), submits `--jobs`
long `sleep` jobs as one identity and waits until every one is `running`. Then, interleaved for
`--rounds` rounds, three phases of `--phase` seconds each:

- idle: nobody follows the jobs;
- poll: `GET /v1/jobs/{id}` of every job once per `--interval` seconds (requests spread evenly,
  a bounded number in flight: a poll the API cannot answer in time is counted late, not queued);
- feed: one `GET /v1/jobs/events` stream open for the whole phase.

In every phase the same identity submits one short job (`true`) per second, so the feed has
changes to carry (3 events each) and the API the same background work in each phase. Per phase
it prints the API process's CPU seconds (loadtests/cpu.py: the process tree), the polls answered
or the events received, and the load average; at the end the ratio feed/poll (target: <= 1/5)
with and without the idle phase's CPU. Bounded: a fixed duration, 127.0.0.1 only; the API's
shutdown kills the jobs and the rig's exit their sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.cpu import tree_seconds
from loadtests.server import config_data, serve_config, stop_api, tuned_host

IN_FLIGHT = 64  # polls in flight at most (a portal's connection pool)


def agent_host(host: Any, jobs: int) -> dict[str, Any]:
    per_connection = 128
    return {
        "hostname": host.address,
        "port": host.port,
        "username": host.username,
        "client_keys": [host.client_key],
        "known_hosts": host.known_hosts,
        "exec_mode": "agent",
        "limits": {
            "min_connections": 1,
            "max_connections": -(-jobs // per_connection) + 1,
            "agent_max_commands": per_connection,
            "max_waiters": jobs + 100,
        },
    }


async def submit(client: httpx.AsyncClient, argv: list[str], timeout: float = 60) -> str:
    body = {"host": "local", "argv": argv, "timeout": timeout}
    r = await client.post("/v1/jobs", json=body, headers={"Prefer": "wait=0"})
    if r.status_code not in (201, 202):
        raise RuntimeError(f"submit: {r.status_code} {r.text[:200]}")
    return str(r.json()["id"])


async def all_running(client: httpx.AsyncClient, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = await client.get("/v1/jobs", params={"state": "running", "limit": 1000})
        running = {j["id"] for j in r.json()["items"]}
        cursor = r.json()["next_cursor"]
        while cursor:
            r = await client.get("/v1/jobs", params={"state": "running", "limit": 1000,
                                                     "cursor": cursor})  # fmt: skip
            running |= {j["id"] for j in r.json()["items"]}
            cursor = r.json()["next_cursor"]
        if running >= set(ids):
            return
        print(f"  {len(running & set(ids))} of {len(ids)} running", flush=True)
        await asyncio.sleep(2)
    raise RuntimeError("the jobs did not all start in time")


async def background(client: httpx.AsyncClient, until: float) -> int:
    """One short job per second: the changes every phase has."""
    made = 0
    while time.monotonic() < until:
        await submit(client, ["true"])
        made += 1
        await asyncio.sleep(1.0)
    return made


async def poll(
    client: httpx.AsyncClient, ids: list[str], interval: float, until: float
) -> dict[str, int]:
    """Each job once per `interval`, spread evenly; at most IN_FLIGHT at once."""
    gate = asyncio.Semaphore(IN_FLIGHT)
    counts = {"ok": 0, "late": 0, "failed": 0}
    spacing = interval / len(ids)
    tasks: set[asyncio.Task[None]] = set()

    async def one(job_id: str) -> None:
        try:
            r = await client.get(f"/v1/jobs/{job_id}")
            counts["ok" if r.status_code == 200 else "failed"] += 1
        except httpx.HTTPError:
            counts["failed"] += 1
        finally:
            gate.release()

    start = time.monotonic()
    n = 0
    while True:
        due = start + n * spacing
        if due >= until:
            break
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        if gate.locked():
            counts["late"] += 1  # the API is behind: this poll is skipped, not queued
        else:
            await gate.acquire()
            task = asyncio.create_task(one(ids[n % len(ids)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        n += 1
    await asyncio.gather(*tasks)
    return counts


async def feed(client: httpx.AsyncClient, until: float) -> dict[str, int]:
    counts = {"events": 0, "keepalives": 0}
    try:
        async with asyncio.timeout(max(0.0, until - time.monotonic())):
            async with client.stream("GET", "/v1/jobs/events",
                                     timeout=httpx.Timeout(30, read=None)) as r:  # fmt: skip
                async for line in r.aiter_lines():
                    if line.startswith("event: job."):
                        counts["events"] += 1
                    elif line.startswith(":"):
                        counts["keepalives"] += 1
    except TimeoutError:
        pass
    return counts


async def phase(kind: str, client: httpx.AsyncClient, ids: list[str], seconds: float,
                interval: float, pid: int) -> dict[str, Any]:  # fmt: skip
    cpu0, t0 = tree_seconds(pid), time.monotonic()
    until = t0 + seconds
    work: list[Any] = [background(client, until)]
    if kind == "poll":
        work.append(poll(client, ids, interval, until))
    elif kind == "feed":
        work.append(feed(client, until))
    results = await asyncio.gather(*work)
    elapsed = time.monotonic() - t0
    cpu = tree_seconds(pid) - cpu0
    out = {"phase": kind, "seconds": round(elapsed, 1), "api_cpu_s": round(cpu, 2),
           "api_cpu_pct": round(100 * cpu / elapsed, 1), "background_jobs": results[0],
           "load": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    if len(results) > 1:
        out |= results[1]
    print(json.dumps(out), flush=True)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from api.local import local_token, resolve_config
    from api.settings import Settings

    with tuned_host("portals") as (host, tmp):
        config = config_data(agent_host(host, args.jobs))
        api_dir = tmp / "api"
        proc, url = serve_config(config, backend="asyncssh", data_dir=api_dir, log=tmp / "api.log")
        try:
            settings = Settings(data_dir=api_dir)
            token = local_token(settings, resolve_config(settings), "portal",
                                ["jobs:read", "jobs:write"])  # fmt: skip
            limits = httpx.Limits(
                max_connections=IN_FLIGHT + 8, max_keepalive_connections=IN_FLIGHT + 8
            )
            auth = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(
                base_url=url, timeout=60, limits=limits, headers=auth
            ) as client:
                sleep = int(args.phase * 3 * args.rounds + 600)
                ids = []
                for _ in range(args.jobs):
                    ids.append(await submit(client, ["sleep", str(sleep)], sleep + 60))
                await all_running(client, ids, timeout=300)
                print(f"{len(ids)} jobs running; load {os.getloadavg()}", flush=True)
                phases: list[dict[str, Any]] = []
                for _ in range(args.rounds):
                    for kind in ("idle", "poll", "feed"):
                        phases.append(
                            await phase(kind, client, ids, args.phase, args.interval, proc.pid)
                        )
        finally:
            stop_api(proc)

    def mean(kind: str) -> float:
        return float(
            statistics.mean(p["api_cpu_s"] / p["seconds"] for p in phases if p["phase"] == kind)
        )

    idle, polled, fed = mean("idle"), mean("poll"), mean("feed")
    # On a loaded box the load generator may not reach jobs/interval polls a second (it counts
    # the ones it skipped as late): the API CPU per poll answered, above idle, scaled to the
    # full rate, is what polling every job every `interval` seconds would cost.
    polls = [p for p in phases if p["phase"] == "poll"]
    answered = sum(p["ok"] for p in polls) / sum(p["seconds"] for p in polls)
    per_poll = max(polled - idle, 0.0) / answered if answered else 0.0
    full = idle + per_poll * args.jobs / args.interval
    summary = {
        "api_cpu_per_s": {"idle": round(idle, 3), "poll": round(polled, 3), "feed": round(fed, 3)},
        "polls_per_s": {"wanted": args.jobs / args.interval, "answered": round(answered, 1)},
        "api_cpu_ms_per_poll": round(1000 * per_poll, 3),
        "poll_at_full_rate_cpu_per_s": round(full, 3),
        "feed_over_poll_measured": round(fed / polled, 3),
        "feed_over_poll_full_rate": round(fed / full, 3),
        "target": "<= 0.2",
        "load": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="running jobs to follow")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of idle, poll, feed")
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between polls of a job"
    )
    parser.add_argument("--out", type=Path, help="write the summary here as JSON")
    args = parser.parse_args(argv)
    summary = asyncio.run(run(args))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
