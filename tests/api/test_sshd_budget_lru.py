"""The least recently used idle connection anywhere closes for another process
(api/sshd_budget.py, docs/pool.md "Many processes, one sshd"): real processes, each a pool with
its own `RedisBudget` as an API worker or replica has, on the rig's stock sshd with real
accounts and the real Redis (a key prefix of each test's own). The processes that hold
connections are separate Python processes driven over their stdin (`Holder`); the one that
needs a connection is the test's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from api.sshd_budget import RedisBudget
from sshpool import Pool, Target
from sshpool.devhost.accounts import Account, ensure_accounts
from sshpool.devhost.host import LocalHost
from tests.api.api_helpers import REDIS_URL

MakeHost = Callable[..., LocalHost]

# A process holding connections: one pool with its RedisBudget (loop and listener running),
# told over stdin what to run, answering one JSON line per order.
HOLDER = """
import asyncio, json, sys
from sshpool import Limits, Pool, Target
from api.sshd_budget import RedisBudget

async def main():
    spec = json.loads(sys.argv[1])
    budget = RedisBudget(spec["url"], spec["processes"], spec["name"], prefix=spec["prefix"])
    tasks = [asyncio.create_task(budget.loop()), asyncio.create_task(budget.listen())]
    pool = Pool(coordinator=budget)
    targets = [
        Target(spec["host"], user, (key,), spec["known_hosts"], port=spec["port"],
               limits=Limits(**spec["limits"]))
        for user, key in spec["accounts"]
    ]
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    held = []

    def say(**what):
        print(json.dumps(what), flush=True)

    say(ready=budget.me)
    while line := await reader.readline():
        order, *args = line.decode().split()
        if order == "run":
            result = await pool.run(targets[int(args[0])], ["true"], acquire_timeout=60)
            say(ok=result.ok)
        elif order == "hold":
            started = loop.create_future()
            held.append(asyncio.create_task(pool.run(
                targets[int(args[0])], ["sleep", args[1]], acquire_timeout=60, timeout=60,
                on_started=lambda pgid: started.done() or started.set_result(pgid))))
            await started
            say(holding=int(args[0]))
        elif order == "wait":
            results = await asyncio.gather(*held)
            say(exits=[r.exit_status for r in results])
        elif order == "stats":
            stats = pool.stats()
            sshd = next(iter(pool.sshd_stats().values()))
            say(connections=[stats[t]["connections"] if t in stats else 0 for t in targets],
                counters=sshd["counters"])

asyncio.run(main())
"""


class Holder:
    """One holding process (HOLDER) and its orders."""

    def __init__(self, proc: asyncio.subprocess.Process, me: str) -> None:
        self.proc = proc
        self.me = me

    @staticmethod
    async def answer(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line, "the holding process ended"
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def order(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        return await self.answer(self.proc)


@contextlib.asynccontextmanager
async def holders(
    n: int, host: LocalHost, accounts: list[Account], prefix: str, processes: int, limits: dict
) -> AsyncIterator[list[Holder]]:
    """`n` holding processes on `host`, each knowing every account of `accounts`."""
    started: list[asyncio.subprocess.Process] = []
    try:
        found: list[Holder] = []
        for i in range(n):
            spec = {
                "url": REDIS_URL,
                "prefix": prefix,
                "processes": processes,
                "name": f"holder{i}",
                "host": host.address,
                "port": host.port,
                "known_hosts": host.known_hosts,
                "accounts": [(a.name, str(a.key)) for a in accounts],
                "limits": limits,
            }
            proc = await asyncio.create_subprocess_exec(
                *(sys.executable, "-c", HOLDER, json.dumps(spec)),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                cwd=Path(__file__).parents[2],
            )
            started.append(proc)
            found.append(Holder(proc, (await Holder.answer(proc))["ready"]))
        yield found
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def needing_process(prefix: str, processes: int) -> AsyncIterator[Pool]:
    """This test's own pool and RedisBudget: the process that needs a connection."""
    budget = RedisBudget(REDIS_URL, processes, "needing", prefix=prefix)
    pool = Pool(coordinator=budget)
    tasks = [asyncio.create_task(f()) for f in (budget.loop, budget.listen)]
    try:
        yield pool
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pool.close()
        await budget.close()


async def offered(prefix: str, host: LocalHost, expected: list[str]) -> None:
    """Wait (30 s at most) until Redis knows the sshd's idle connections as `expected`: their
    owners, least recently used first (each process offers them at its next step)."""
    seen: list[str] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while (seen := await idle_owners(prefix, host)) != expected:  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # another process's state: nothing to await
    assert seen == expected


async def idle_owners(prefix: str, host: LocalHost) -> list[str]:
    """The owners of the sshd's idle connections Redis knows, least recently used first."""
    import redis.asyncio as aioredis

    client: Any = aioredis.from_url(REDIS_URL)
    try:
        members = await client.zrange(f"{prefix}sshd:{host.address}:{host.port}:idle", 0, -1)
    finally:
        await client.aclose()
    return [m.decode().rpartition("|")[0] for m in members]


LIMITS = {"max_total_connections": 4, "max_connections": 1, "max_sessions": 1}


def setup(make_host: MakeHost, tmp_path: Path) -> tuple[LocalHost, list[Account], str]:
    accounts = ensure_accounts(5, data_dir=tmp_path)
    return make_host("stock", researchers=True), accounts, f"test-{secrets.token_hex(6)}:"


def needing(account: Account, host: LocalHost) -> Target:
    return account.target(host, **LIMITS)


async def test_the_least_recently_used_idle_connection_anywhere_closes_for_another_process(
    make_host: MakeHost, tmp_path: Path
) -> None:
    """Two processes hold the whole budget (4) in idle connections, two each, used in turns
    (P1, P2, P1, P2, then P1's first again): a third process needs one for a fifth account.
    Only the least recently used of the four closes, P2's first (P2 is not the process that
    used the sshd last, nor above the other), and the job runs; the other three stay open.
    Before, each process above its fair level closed its own idle ones: all four."""
    host, accounts, prefix = setup(make_host, tmp_path)
    async with holders(2, host, accounts[:4], prefix, 3, LIMITS) as (p1, p2):
        for holder, i in ((p1, 0), (p2, 1), (p1, 2), (p2, 3), (p1, 0)):
            assert (await holder.order(f"run {i}"))["ok"]
        await offered(prefix, host, [p2.me, p1.me, p2.me, p1.me])
        async with needing_process(prefix, 3) as pool:
            result = await pool.run(needing(accounts[4], host), ["id", "-un"], acquire_timeout=60)
            stats = next(iter(pool.sshd_stats().values()))
            await asyncio.sleep(2.0)  # two renewals of every process: nothing more closes
            one, two = await p1.order("stats"), await p2.order("stats")
    assert result.ok and result.stdout.decode().strip() == accounts[4].name
    assert one["connections"] == [1, 0, 1, 0] and two["connections"] == [0, 0, 0, 1]
    assert two["counters"].get("lent") == 1 and "lent" not in one["counters"]
    assert stats["counters"]["closes_asked"] == 1


async def test_a_busy_connection_never_closes_for_another_process(
    make_host: MakeHost, tmp_path: Path
) -> None:
    """A process holds the budget (4): two connections running a command (used before the
    others), two idle. Another process needs one: the older idle one closes, the busy ones
    run their commands to the end (exit 0) and the newer idle one stays."""
    host, accounts, prefix = setup(make_host, tmp_path)
    async with holders(1, host, accounts[:4], prefix, 2, LIMITS) as (p1,):
        assert (await p1.order("hold 0 15"))["holding"] == 0
        assert (await p1.order("hold 1 15"))["holding"] == 1
        assert (await p1.order("run 2"))["ok"]
        assert (await p1.order("run 3"))["ok"]
        await offered(prefix, host, [p1.me] * 2)
        async with needing_process(prefix, 2) as pool:
            result = await pool.run(needing(accounts[4], host), ["true"], acquire_timeout=60)
            during = await p1.order("stats")
            exits = await p1.order("wait")
    assert result.ok
    assert during["connections"] == [1, 1, 0, 1]
    assert exits["exits"] == [0, 0]


async def test_a_dead_holders_idle_connections_free_with_its_lease(
    make_host: MakeHost, tmp_path: Path
) -> None:
    """A process holding the budget (4) in idle connections is SIGKILLed: the process that
    needs one asks it to close one, nobody answers, and its lease (and what Redis knew of its
    idle connections) lapses within the lease's time to live; the job then runs."""
    host, accounts, prefix = setup(make_host, tmp_path)
    async with holders(1, host, accounts[:4], prefix, 2, LIMITS) as (p1,):
        for i in range(4):
            assert (await p1.order(f"run {i}"))["ok"]
        await offered(prefix, host, [p1.me] * 4)
        p1.proc.send_signal(signal.SIGKILL)
        await p1.proc.wait()
        async with needing_process(prefix, 2) as pool:
            result = await pool.run(needing(accounts[4], host), ["true"], acquire_timeout=60)
            stats = next(iter(pool.sshd_stats().values()))
        left = await idle_owners(prefix, host)
    assert result.ok
    assert stats["counters"]["closes_asked"] >= 1
    assert p1.me not in left
