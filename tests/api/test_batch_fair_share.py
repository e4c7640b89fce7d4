"""A batch job's Slurm commands wait in its owner's turns on a saturated host (F10 of issue 33),
and so do file transfers (issue 27, item 4): pool logic through the API's own callers, on the fake
backend (sshpool.devhost.FakeBackend)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

from api.batchspec import key_digest
from api.config import Config
from api.jobs import BatchJobs
from api.jobs.scheduler import SlurmClient
from api.policy import Policy
from api.store import JobRow
from sshpool import Limits, Pool, Target
from sshpool.devhost import FakeBackend
from sshpool.devhost.fake import backlog_queued

# The host's channel slots in these tests. Counted in the fake host's `order` (event order, which
# a loaded box does not change, where milliseconds stretch): of the other owner's commands, at
# most those already given a freed slot but not yet begun when Bob asked (SLOTS), then one turn
# (Bob joins the ring behind Alice), may start ahead of Bob's. Behind her backlog: ~290.
SLOTS = 4
FAIR_AHEAD = SLOTS + 1


async def test_one_owners_slurm_backlog_delays_another_owners_command_by_one_turn() -> None:
    """Alice's 300 scancels are queued on a host with 4 slots; Bob's single scancels, one after
    the other, each wait at most one turn (before, every job's Slurm commands shared one queue:
    Bob's waited behind Alice's whole backlog)."""
    backend = FakeBackend(exec_time=0.05)
    turn = backend.exec_time
    target = Target(
        "fake",
        "user",
        ("key",),
        "known_hosts",
        limits=Limits(max_connections=1, max_sessions=SLOTS),
    )  # type: ignore[arg-type]
    async with Pool(backend) as pool:
        alice = SlurmClient(pool, target, tenant=("sshapi-local", "alice"))
        bob = SlurmClient(pool, target, tenant=("sshapi-local", "bob"))
        backlog = [asyncio.create_task(alice.cancel(str(n + 1))) for n in range(300)]
        await backlog_queued(pool, target)
        ahead, waited = [], []
        for n in range(5):
            before, t0 = len(backend.order), time.perf_counter()
            await bob.cancel(str(1000 + n))
            waited.append(time.perf_counter() - t0)
            ahead.append(backend.started_ahead(before, f"scancel {1000 + n}"))
        for task in backlog:
            task.cancel()
        await asyncio.gather(*backlog, return_exceptions=True)
    print(
        f"FIGURE bob_scancel: ahead {ahead}, max {max(waited) * 1000:.0f} ms, "
        f"turn {turn * 1000:.0f} ms"
    )
    assert max(ahead) <= FAIR_AHEAD, ahead


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
                "h": {
                    **host,
                    "limits": {"max_connections": 1, "max_sessions": SLOTS},
                    "scheduler": {},
                }
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

        async def transfer(owner: str) -> int:
            before = len(backend.order)
            async with pool.sftp(target, tenant=("sshapi-local", owner)) as fs:
                # Every session is "sftp" in the order: those started since it asked but its
                # own, including the few of Alice's given the other slots after its own.
                started = len(backend.order) - before - 1
                await fs.realpath(".")
                await asyncio.sleep(turn)
            return started

        async def poll(row: JobRow) -> int:
            before = len(backend.order)
            # The fake host's answer is no output file's: the poll fails after its turn.
            with contextlib.suppress(ValueError):
                await jobs.read_bytes(row, "stdout", 0, 1024)
            return backend.started_ahead(before, key_digest(row.id)[:12])

        alice, bob = batch_job("alice"), batch_job("bob")
        backlog = [
            asyncio.create_task(transfer("alice") if n % 3 else poll(alice)) for n in range(300)
        ]
        await backlog_queued(pool, target)
        commands, sessions, polled, queued = [], [], [], []
        for n in range(5):
            before = len(backend.order)
            result = await pool.run(target, [f"b{n}"], tenant=("sshapi-local", "bob"))
            commands.append(backend.started_ahead(before, f"; b{n}"))
            queued.append(result.timings["queue"])
            sessions.append(await transfer("bob"))
            polled.append(await poll(bob))
        for task in backlog:
            task.cancel()
        await asyncio.gather(*backlog, return_exceptions=True)
    print(
        f"FIGURE bystander_ahead: command {commands}, session {sessions}, batch poll {polled}; "
        f"command queue max {max(queued) * 1000:.1f} ms, turn {turn * 1000:.0f} ms"
    )
    assert max(commands) <= FAIR_AHEAD, commands
    assert max(polled) <= FAIR_AHEAD, polled
    assert max(sessions) <= FAIR_AHEAD + SLOTS - 1, sessions
