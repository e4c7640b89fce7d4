"""What the webhook outbox costs a job without webhooks: the store's CPU per state change with
the outbox statement (an INSERT ... SELECT that finds no webhook) and without it, interleaved.

    python -m loadtests.outbox_cost --jobs 2000 --rounds 6
    python -m loadtests.outbox_cost --database-url postgresql+asyncpg://postgres@127.0.0.1:5432/test

Each round inserts `--jobs` jobs, then moves each to `running` and to `succeeded` (2 state
changes, 50 at a time through the store's writer, as the runner does), rounds alternating with
and without the outbox statement. Prints this process's CPU time per state change (user +
system: the writer runs in it) per variant, each round's, and the load average. A figure, not a
test."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from api.store import JobRow, Store, new_id, outbox, utcnow
from api.tasks import supervised


async def one_round(store: Store, jobs: int) -> float:
    """CPU seconds per state change over one round."""
    rows = [
        JobRow(
            id=new_id(),
            owner_iss="bench",
            owner_sub=f"user-{n % 20}",
            replica="bench",
            host="local",
            target="u@h:22",
            argv=["true"],
            timeout=10.0,
            state="queued",
            created_at=utcnow(),
        )
        for n in range(jobs)
    ]
    await asyncio.gather(*(store.insert(r) for r in rows))
    gate = asyncio.Semaphore(50)

    async def change(row: JobRow) -> None:
        async with gate:
            await store.update(row.id, only_active=True, state="running", started_at=utcnow())
            await store.update(row.id, only_active=True, state="succeeded", exit_status=0)

    start = time.process_time()
    await asyncio.gather(*(change(r) for r in rows))
    return (time.process_time() - start) / (2 * jobs)


async def run(url: str, schema: str | None, jobs: int, rounds: int) -> dict[str, list[float]]:
    real = outbox.params
    found: dict[str, list[float]] = {"with outbox": [], "without": []}
    async with supervised() as tasks:
        store = Store(url, schema=schema)
        await store.start(tasks)
        try:
            for n in range(rounds):
                variant = "with outbox" if n % 2 == 0 else "without"
                outbox.params = real if variant == "with outbox" else (lambda *_: None)
                found[variant].append(await one_round(store, jobs))
        finally:
            outbox.params = real
            await store.close()
    return found


async def drop(url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--database-url", default=None, help="PostgreSQL (default: SQLite)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="outbox-cost-") as tmp:
        schema = None
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'jobs.db'}"
        if args.database_url:
            url, schema = args.database_url, f"sshapi_bench_{uuid.uuid4().hex[:10]}"
        try:
            found = asyncio.run(run(url, schema, args.jobs, args.rounds))
        finally:
            if schema:
                asyncio.run(drop(url, schema))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for variant, values in found.items():
        each = ", ".join(f"{v * 1e6:.0f}" for v in values)
        print(
            f"{variant}: median {statistics.median(values) * 1e6:.0f} us CPU per state change "
            f"(rounds: {each})"
        )
    print(f"load average {load}")


if __name__ == "__main__":
    main()
