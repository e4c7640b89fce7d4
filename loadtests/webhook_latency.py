"""Webhook delivery latency: from a job's state change to its webhook delivery arriving at a
receiver on this machine (one clock), with one API process or two replicas on one PostgreSQL.

    python -m loadtests.webhook_latency --jobs 200
    python -m loadtests.webhook_latency --jobs 200 --replicas 2 --database-url postgresql+asyncpg://postgres@127.0.0.1:5432/test

It starts its own tuned local host and API process(es) (SQLite unless `--database-url`), a
receiver (loadtests/webhook_receiver.py, which verifies every signature), subscribes it to the
final states, and submits `--jobs` jobs (half `true`, half `false`), `--concurrency` at a time,
to the replicas in turn. A delivery's latency is its arrival time minus the event's `timestamp`
(taken in the transaction that recorded the state). Prints p50, p90, p99 and max, the count of
deliveries and duplicates, and the load average. A figure, not a test: the target is p99 <= 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import time
import uuid
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import httpx

from api.local import LOCAL_AUDIENCE, LOCAL_ISSUER, mint
from loadtests.server import config_data, serve_config, stop_api, tuned_host
from loadtests.webhook_receiver import Receiver

FINAL = ["job.succeeded", "job.failed", "job.timed_out", "job.cancelled", "job.lost"]


def api_config(host: dict[str, object]) -> dict[str, object]:
    config = config_data(host)
    config["webhooks"] = {
        "allowed_urls": ["http://127.0.0.1:*"],
        "allowed_networks": ["127.0.0.0/8"],
        "max_in_flight_per_identity": 16,
    }
    return config


async def measure(urls: list[str], token: str, jobs: int, concurrency: int) -> list[float]:
    headers = {"Authorization": f"Bearer {token}"}
    async with Receiver() as receiver, httpx.AsyncClient(headers=headers, timeout=60) as c:
        r = await c.post(f"{urls[0]}/v1/webhooks", json={"url": receiver.url, "events": FINAL})
        r.raise_for_status()
        receiver.secret = r.json()["secret"]
        gate = asyncio.Semaphore(concurrency)

        async def one(n: int) -> None:
            body = {"host": "local", "argv": ["true" if n % 2 else "false"]}
            async with gate:
                answer = await c.post(f"{urls[n % len(urls)]}/v1/jobs", json=body)
                answer.raise_for_status()

        await asyncio.gather(*(one(n) for n in range(jobs)))
        deadline = time.monotonic() + 120
        while len({r.id for r in receiver.received}) < jobs and time.monotonic() < deadline:  # noqa: ASYNC110 (an outside condition)
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)  # a duplicate would come by now
        received = receiver.received
        ids = [r.id for r in received]
        duplicates = len(ids) - len(set(ids))
        invalid = sum(not r.valid for r in received)
        print(
            f"{len(set(ids))}/{jobs} delivered, {duplicates} duplicate(s), "
            f"{invalid} bad signature(s)"
        )
        return [
            r.at - datetime.fromisoformat(r.message["timestamp"].replace("Z", "+00:00")).timestamp()
            for r in received
        ]


def drop_schema(url: str, schema: str) -> None:
    """The replicas' PostgreSQL schema, dropped once they stopped (made for this run)."""
    import asyncpg

    async def drop() -> None:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    asyncio.run(drop())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--database-url", default=None, help="PostgreSQL for several replicas (SQLite: one)"
    )
    args = parser.parse_args(argv)
    if args.replicas > 1 and not args.database_url:
        parser.error("--replicas above 1 needs --database-url (a PostgreSQL both share)")
    secret = secrets.token_urlsafe(32)
    schema = f"sshapi_bench_{uuid.uuid4().hex[:10]}"
    with ExitStack() as stack:
        if args.database_url:
            stack.callback(drop_schema, args.database_url, schema)
        local, scratch = stack.enter_context(tuned_host("webhook-bench"))
        host = {
            "hostname": local.address,
            "port": local.port,
            "username": local.username,
            "client_keys": [local.client_key],
            "known_hosts": local.known_hosts,
        }
        urls = []
        for n in range(args.replicas):
            env = {"SSHAPI_JWT_SECRET": secret, "SSHAPI_REPLICA": f"bench-{n}"}
            if args.database_url:
                env |= {"SSHAPI_DATABASE_URL": args.database_url}
                env |= {"SSHAPI_DATABASE_SCHEMA": schema}
            proc, url = serve_config(
                api_config(host),
                backend="asyncssh",
                data_dir=Path(scratch) / f"api-{n}",
                env=env,
                log=Path(scratch) / f"api-{n}.log",
            )
            stack.callback(stop_api, proc)
            urls.append(url)
        token = mint(
            secret,
            issuer=LOCAL_ISSUER,
            audience=LOCAL_AUDIENCE,
            subject="bench",
            scopes=["jobs:read", "jobs:write"],
        )
        seconds = sorted(asyncio.run(measure(urls, token, args.jobs, args.concurrency)))
    if len(seconds) < 2:
        raise SystemExit("too few deliveries to give a figure")
    q = statistics.quantiles(seconds, n=100, method="inclusive")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"webhook delivery latency from the state change, {len(seconds)} deliveries, "
        f"{args.replicas} replica(s): p50 {q[49] * 1000:.0f} ms, p90 {q[89] * 1000:.0f} ms, "
        f"p99 {q[98] * 1000:.0f} ms, max {seconds[-1] * 1000:.0f} ms (target p99 <= 2000 ms); "
        f"load average {load}"
    )


if __name__ == "__main__":
    main()
