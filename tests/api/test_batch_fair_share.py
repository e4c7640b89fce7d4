"""A batch job's Slurm commands wait in its owner's turns on a saturated host (F10 of issue 33),
and so do file transfers (issue 27, item 4): pool logic through the API's own callers, on the fake
backend (sshpool.devhost.FakeBackend)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

from api.config import Config
from api.jobs import BatchJobs
from api.jobs.scheduler import SlurmClient
from api.policy import Policy
from api.store import JobRow
from sshpool import Limits, Pool, Target
from sshpool.devhost import FakeBackend


async def test_one_owners_slurm_backlog_delays_another_owners_command_by_one_turn() -> None:
    """Alice's 300 scancels are queued on a host with 4 slots; Bob's single scancels, one after
    the other, each wait at most one turn (before, every job's Slurm commands shared one queue:
    Bob's waited behind Alice's whole backlog)."""
    backend = FakeBackend(exec_time=0.05)
    turn = backend.exec_time
    target = Target(
        "fake", "user", ("key",), "known_hosts", limits=Limits(max_connections=1, max_sessions=4)
    )  # type: ignore[arg-type]
    async with Pool(backend) as pool:
        alice = SlurmClient(pool, target, tenant=("sshapi-local", "alice"))
        bob = SlurmClient(pool, target, tenant=("sshapi-local", "bob"))
        backlog = [asyncio.create_task(alice.cancel(str(n + 1))) for n in range(300)]
        await asyncio.sleep(0.1)  # queued, the four slots busy
        waited = []
        for n in range(5):
            t0 = time.perf_counter()
            await bob.cancel(str(1000 + n))
            waited.append(time.perf_counter() - t0)
        for task in backlog:
            task.cancel()
        await asyncio.gather(*backlog, return_exceptions=True)
    # One turn waiting for a slot, one running, plus scheduling slack on a shared box.
    assert max(waited) <= 2 * turn + 0.03, waited


async def test_one_identitys_transfers_and_batch_polls_delay_anothers_commands_one_turn() -> None:
    """Alice queues 200 SFTP sessions (a transfer each, holding its channel one turn) and 100
    batch polls (what the follower of her batch job reads: `BatchJobs.read_bytes`) on a host
    with 4 slots. Bob's single commands, transfers and polls of his own batch job, one after the
    other, each wait one turn at most: sessions and polls take their owner's turns (Pool.sftp's
    tenant; BatchJobs passes the job's owner to SlurmClient). Were the polls, or the sessions,
    in one queue shared by every identity's, Bob's would wait behind Alice's backlog."""
    backend = FakeBackend(exec_time=0.05)
    turn = backend.exec_time
    host = {"hostname": "fake", "username": "user", "client_keys": ["key"], "known_hosts": "kh"}
    config = Config.model_validate(
        {
            "issuers": [{"issuer": "sshapi-local", "audience": "a"}],
            "hosts": {
                "h": {**host, "limits": {"max_connections": 1, "max_sessions": 4}, "scheduler": {}}
            },
        }
    )
    target = config.hosts["h"].target()

    def batch_job(owner: str) -> JobRow:
        return JobRow(
            id=f"job-{owner}",
            owner_iss="sshapi-local",
            owner_sub=owner,
            replica="r",
            host="h",
            target=str(target),
            timeout=60,
            state="running",
            created_at=datetime.now(UTC),
            batch={},
            scheduler_job_id="1",
        )

    async with Pool(backend) as pool:
        jobs = BatchJobs(config, Policy(config), None, pool, None)  # type: ignore[arg-type]

        async def transfer(owner: str) -> float:
            t0 = time.perf_counter()
            async with pool.sftp(target, tenant=("sshapi-local", owner)) as fs:
                waited = time.perf_counter() - t0
                await fs.realpath(".")
                await asyncio.sleep(turn)
            return waited

        async def poll(row: JobRow) -> float:
            t0 = time.perf_counter()
            # The fake host's answer is no output file's: the poll fails after its turn.
            with contextlib.suppress(ValueError):
                await jobs.read_bytes(row, "stdout", 0, 1024)
            return time.perf_counter() - t0

        alice, bob = batch_job("alice"), batch_job("bob")
        backlog = [
            asyncio.create_task(transfer("alice") if n % 3 else poll(alice)) for n in range(300)
        ]
        await asyncio.sleep(0.1)  # the backlog is queued, the four slots busy
        assert pool.stats()[target]["waiters"] > 250
        queued, polled = [], []
        for _ in range(5):
            result = await pool.run(target, ["b"], tenant=("sshapi-local", "bob"))
            queued.append(result.timings["queue"])
            queued.append(await transfer("bob"))
            polled.append(await poll(bob))
        for task in backlog:
            task.cancel()
        await asyncio.gather(*backlog, return_exceptions=True)
    print(
        f"FIGURE bystander_wait_ms: command or session max {max(queued) * 1000:.1f}, "
        f"batch poll (with its run) max {max(polled) * 1000:.1f}, turn {turn * 1000:.0f}"
    )
    # One turn waiting (a poll: plus its own turn running), plus scheduling slack on a shared box.
    assert max(queued) <= turn + 0.02, queued
    assert max(polled) <= 2 * turn + 0.03, polled
