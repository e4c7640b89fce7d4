"""A batch job's Slurm commands wait in its owner's turns on a saturated host (F10 of issue 33):
pure pool logic, on the fake backend (sshpool.devhost.FakeBackend)."""

from __future__ import annotations

import asyncio
import time

from api.jobs.scheduler import SlurmClient
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
        alice = SlurmClient(pool, target, tenant=("iss", "alice"))
        bob = SlurmClient(pool, target, tenant=("iss", "bob"))
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
