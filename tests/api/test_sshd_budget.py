"""One sshd's budget shared by several API processes through Redis (api/sshd_budget.py): two
pools in one test process, each with its own `RedisBudget` as two workers would have, on the
rig's stock sshd with real accounts; a process SIGKILLed while holding leases; Redis
unreachable and Redis killed mid-burst. Each test has a key prefix of its own in the real
Redis. The static share's logic on the fake backend: tests/sshpool/test_budget_share.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from api.metrics import Metrics
from api.sshd_budget import RedisBudget
from sshpool import AuthenticationFailed, Limits, Pool, PoolTimeout, Target
from sshpool.devhost import FakeBackend
from sshpool.devhost.accounts import ensure_accounts
from sshpool.devhost.host import LocalHost
from tests.api.api_helpers import REDIS_URL, eventually, free_port

MakeHost = Callable[..., LocalHost]


@contextlib.asynccontextmanager
async def shared_pools(
    n: int, backend: object = "asyncssh", url: str = REDIS_URL, ttl: float = 8.0
) -> AsyncIterator[list[Pool]]:
    """`n` pools, each with its own RedisBudget (its loop and listener running), on one
    prefix of their own, as `n` API processes."""
    prefix = f"test-{secrets.token_hex(6)}:"
    budgets = [RedisBudget(url, n, f"p{i}", prefix=prefix, ttl=ttl) for i in range(n)]
    pools = [Pool(backend, coordinator=b) for b in budgets]  # type: ignore[arg-type]
    tasks = [asyncio.create_task(f()) for b in budgets for f in (b.loop, b.listen)]
    try:
        yield pools
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool, budget in zip(pools, budgets, strict=True):
            await pool.close()
            await budget.close()


def established(port: int) -> int:
    """Client connections to `port` the kernel holds established (what sshd sees)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
            count += 1
    return count


def held(pools: list[Pool]) -> int:
    """Connections the pools count: made or being made, not yet closed."""
    total = 0
    for pool in pools:
        for s in pool.sshd_stats().values():
            total += s["connections_busy"] + s["connections_idle"] + s["connections_closing"]
            total += s["handshakes_in_flight"]
    return total


def in_flight(pools: list[Pool]) -> int:
    """Handshakes the pools have in flight to the sshd, all together."""
    return sum(s["handshakes_in_flight"] for p in pools for s in p.sshd_stats().values())


class Sampler:
    """The most of `measure()` seen, every few milliseconds, while running."""

    def __init__(self, measure: Callable[[], int]) -> None:
        self.measure = measure
        self.most = 0
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.most = max(self.most, self.measure())
            await asyncio.sleep(0.005)

    def __enter__(self) -> Sampler:
        self.task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()


async def test_two_processes_share_one_stock_sshds_budget_of_8(
    make_host: MakeHost, tmp_path: Path
) -> None:
    """Two processes (pools), 30 accounts, one command per account each, at once, on a stock
    sshd with a budget of 8 connections: never more than 8 connections in all (the pools'
    count and the kernel's), no drop in sshd's log, every command runs as its account, and
    both processes connect (neither starves). Each with its own budget, they held 16."""
    accounts = ensure_accounts(30, data_dir=tmp_path)
    host = make_host("stock", researchers=True)
    lim = {"max_total_connections": 8, "max_sessions": 2}
    async with shared_pools(2) as pools:
        targets = [a.target(host, **lim) for a in accounts]
        with (
            Sampler(lambda: held(pools)) as ours,
            Sampler(lambda: established(host.port)) as k,
            Sampler(lambda: in_flight(pools)) as gate,
        ):
            results = await asyncio.gather(
                *(
                    p.run(t, ["sh", "-c", "id -un; sleep 0.2"], timeout=60, acquire_timeout=60)
                    for p in pools
                    for t in targets
                )
            )
        stats = [p.sshd_stats()[f"{host.address}:{host.port}"] for p in pools]
        metrics = Metrics()
        metrics.watch_sshds(lambda: {"h": list(pools[0].sshd_stats().values())})
        text = metrics.render().decode()
    names = [r.stdout.decode().strip() for r in results]
    assert names == [a.name for a in accounts] * 2
    assert ours.most <= 8 and k.most <= 8, (ours.most, k.most)
    assert gate.most <= 6, gate.most  # the stock sshd drops from 10 unauthenticated
    assert "drop connection" not in host.log_path.read_text()
    assert all(s["counters"]["handshakes_granted"] >= 1 for s in stats)
    assert all(s["share_mode"] == "redis" for s in stats)
    # /metrics: this process's share, and what all the processes lease of the sshd.
    assert re.search(r'sshpool_sshd_share_connections\{host="h"\} [0-8]\.0', text)
    assert re.search(r'sshpool_sshd_leased_connections\{host="h"\} [0-8]\.0', text)
    assert 'sshpool_sshd_processes{host="h"} 2.0' in text


SCRIPT = """
import asyncio, json, sys
from sshpool import Pool, Target, Limits
from api.metrics import Metrics
from api.sshd_budget import RedisBudget

async def main():
    spec = json.loads(sys.argv[1])
    budget = RedisBudget(spec["url"], 2, "doomed", prefix=spec["prefix"])
    loop = asyncio.create_task(budget.loop())
    limits = Limits(**spec["limits"])
    target = Target(spec["host"], spec["user"], tuple(spec["keys"]), spec["known_hosts"],
                    port=spec["port"], limits=limits)
    pool = Pool(coordinator=budget)
    started = []
    def on_started(pgid):
        started.append(pgid)
        if len(started) == spec["n"]:
            print("running", flush=True)
    await asyncio.gather(*(pool.run(target, ["sleep", "60"], on_started=on_started)
                           for _ in range(spec["n"])))

asyncio.run(main())
"""


async def test_a_killed_process_frees_its_leases_within_10_s(make_host: MakeHost) -> None:
    """A process holding the whole budget (8 connections, each running a command) is
    SIGKILLed: until then the other process gets no connection; within 10 s of the kill it
    connects, and it reaches the whole budget (8 commands at once, on 8 connections)."""
    host = make_host("stock")
    limits = {"max_total_connections": 8, "max_sessions": 1, "max_connections": 8}
    target: Target = host.target(**limits)
    prefix = f"test-{secrets.token_hex(6)}:"
    spec = {
        "url": REDIS_URL,
        "prefix": prefix,
        "limits": limits,
        "host": target.host,
        "port": target.port,
        "user": target.username,
        "keys": list(target.client_keys),
        "known_hosts": target.known_hosts,
        "n": 8,
    }
    doomed = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", SCRIPT, json.dumps(spec)),
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert doomed.stdout is not None
        line = await asyncio.wait_for(doomed.stdout.readline(), 60)
        assert line == b"running\n"
        budget = RedisBudget(REDIS_URL, 2, "survivor", prefix=prefix)
        pool = Pool(coordinator=budget)
        tasks = [asyncio.create_task(f()) for f in (budget.loop, budget.listen)]
        try:
            runs = [
                asyncio.create_task(pool.run(target, ["sleep", "3"], acquire_timeout=60))
                for _ in range(8)
            ]
            await asyncio.sleep(2.0)  # a second renewal of both: still nothing for this one
            key = f"{host.address}:{host.port}"
            before = pool.sshd_stats()[key]
            os.kill(doomed.pid, signal.SIGKILL)
            killed = time.monotonic()
            await eventually(
                lambda: pool.sshd_stats()[key]["counters"].get("handshakes_granted", 0) > 0,
                timeout=30,
            )
            freed = time.monotonic() - killed
            results = await asyncio.gather(*runs)
            after = pool.sshd_stats()[key]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.close()
            await budget.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            doomed.kill()
        await doomed.wait()
    assert before["connections_max"] == 0 and before["handshakes_in_flight"] == 0
    assert freed <= 10.0, freed
    assert all(r.ok for r in results)
    assert after["connections_max"] == 8


async def test_without_redis_each_process_keeps_its_static_share() -> None:
    """Redis unreachable from the start: each of 2 processes keeps budget / 2 = 4 connections
    (and 3 of the 6 handshakes); every command runs."""
    backend = FakeBackend(connect_time=0.01, exec_time=0.05)
    url = f"redis://127.0.0.1:{free_port()}/0"
    targets = [
        Target("fake", f"u{i}", ("k",), "kh", limits=Limits(max_total_connections=8))
        for i in range(20)
    ]
    async with shared_pools(2, backend, url=url, ttl=1.0) as pools:
        results = await asyncio.gather(
            *(p.run(t, ["true"], acquire_timeout=30) for p in pools for t in targets)
        )
        stats = [p.sshd_stats()["fake:22"] for p in pools]
    assert all(r.ok for r in results)
    assert backend.max_alive <= 8 and backend.max_in_flight <= 6
    assert [(s["share_mode"], s["share_connections"]) for s in stats] == [("fallback", 4)] * 2
    assert all(s["connections_max"] <= 4 for s in stats)


async def start_redis(port: int, tmp_path: Path) -> asyncio.subprocess.Process:
    """A private Redis on `port` (nothing on disk), answering."""
    proc = await asyncio.create_subprocess_exec(
        *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
        *("--appendonly", "no", "--dir", str(tmp_path)),
        stdout=asyncio.subprocess.DEVNULL,
    )

    async def answers() -> bool:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return True
        return False

    async with asyncio.timeout(30):
        while not await answers():  # noqa: ASYNC110 (a server starting: nothing to await)
            await asyncio.sleep(0.05)
    return proc


async def test_redis_killed_mid_burst_static_shares_then_leases_again(tmp_path: Path) -> None:
    """Two processes busy on one sshd (budget 8) when their Redis is SIGKILLed: never more
    than 8 connections in all, no command fails; Redis restarted (empty): within 5 s a
    process alone holds more than its static share again."""
    backend = FakeBackend(connect_time=0.02, exec_time=0.05)
    port = free_port()
    redis = await start_redis(port, tmp_path)
    targets = [
        Target("fake", f"u{i}", ("k",), "kh", limits=Limits(max_total_connections=8))
        for i in range(20)
    ]
    stop = asyncio.Event()

    async def stream(pool: Pool) -> int:
        ran = 0
        while not stop.is_set():
            results = await asyncio.gather(
                *(pool.run(t, ["true"], acquire_timeout=30) for t in targets)
            )
            ran += sum(1 for r in results if r.ok)
        return ran

    try:
        async with shared_pools(2, backend, url=f"redis://127.0.0.1:{port}/0") as pools:
            streams = [asyncio.create_task(stream(p)) for p in pools]
            await asyncio.sleep(1.0)
            redis.kill()
            await redis.wait()
            await eventually(
                lambda: all(s["share_mode"] == "fallback" for s in sshd_stats(pools)), 10
            )
            await asyncio.sleep(1.0)
            redis = await start_redis(port, tmp_path)
            back = time.monotonic()
            stop.set()
            ran = await asyncio.gather(*streams)
            max_during = backend.max_alive
            stop.clear()
            alone = asyncio.create_task(stream(pools[0]))
            await eventually(lambda: sshd_stats(pools)[0]["share_connections"] > 4, 30)
            regained = time.monotonic() - back
            stop.set()
            await alone
    finally:
        redis.kill()
        await redis.wait()
    assert max_during <= 8 and backend.max_alive <= 8
    assert all(n > 0 for n in ran)
    assert regained <= 5.0, regained


def sshd_stats(pools: list[Pool]) -> list[dict[str, Any]]:
    return [p.sshd_stats()["fake:22"] for p in pools]


async def test_refused_logins_in_one_process_hold_back_the_others_risky_logins() -> None:
    """Process A's three accounts are refused (3 x 5 s of sshd's penalty, threshold 15): process
    B, which learns the penalty through Redis, holds back the login of an account it never
    logged in (one more refusal would lock the address out), while its known-good account
    keeps running. Each with its own penalty count, B would log the new account in at once."""
    backend = FakeBackend(connect_time=0.01)
    async with shared_pools(2, backend) as (a, b):
        good = Target("fake", "good", ("k",), "kh")
        assert (await b.run(good, ["true"], acquire_timeout=10)).ok
        backend.connect_failures = [AuthenticationFailed("denied") for _ in range(3)]
        for bad in ("bad1", "bad2", "bad3"):
            with pytest.raises(AuthenticationFailed):
                await a.run(Target("fake", bad, ("k",), "kh"), ["true"], acquire_timeout=10)
        sshd = b._sshds[("fake", 22)]
        await eventually(lambda: sshd.penalties.score(asyncio.get_running_loop().time()) > 12)
        with pytest.raises(PoolTimeout):
            await b.run(Target("fake", "new", ("k",), "kh"), ["true"], acquire_timeout=1.0)
        assert (await b.run(good, ["true"], acquire_timeout=10)).ok


async def test_a_reply_lost_after_redis_ran_the_call_never_lets_a_process_over_it() -> None:
    """A process's calls run in Redis but their answers time out (a loaded box: Redis answers
    after the 0.25 s the process waits). Its calls gave its idle connections' slots back, and
    the other process leased the whole budget (8) and holds its connections; the first process,
    falling back, must not take its static share (4) on the strength of the lease it had
    before those calls: it waits. Both processes' connections at once: 8 at most; once its
    answers come through again, its commands run. (Before: 12.)"""
    import redis.exceptions

    backend = FakeBackend(connect_time=0.01, exec_time=0.01)
    lim = Limits(max_total_connections=8)
    mine, theirs, later = (
        [Target("fake", f"{who}{i}", ("k",), "kh", limits=lim) for i in range(n)]
        for who, n in (("a", 8), ("b", 8), ("c", 4))
    )
    lost = 0

    async with shared_pools(2, backend) as pools:
        budget = pools[0].coordinator
        assert isinstance(budget, RedisBudget)
        run_lease = budget._lease

        def stat(n: int) -> dict[str, Any]:
            return pools[n].sshd_stats().get("fake:22", {})

        async def reply_lost(**kwargs: Any) -> Any:
            nonlocal lost
            await run_lease(**kwargs)
            lost += 1
            raise redis.exceptions.TimeoutError("Timeout reading from socket")

        await asyncio.gather(*(pools[0].run(t, ["true"], acquire_timeout=30) for t in mine))
        await eventually(lambda: stat(0)["share_connections"] == 8, 30)
        budget._lease = reply_lost  # type: ignore[assignment]
        backend.exec_time = 1.0  # the other's 8 commands at once: it needs the whole budget
        theirs_ran = await asyncio.gather(
            *(pools[1].run(t, ["true"], acquire_timeout=30) for t in theirs)
        )
        backend.exec_time = 0.01
        await eventually(lambda: lost > 0 and stat(0)["share_mode"] == "fallback", 30)
        waiting = [
            asyncio.create_task(pools[0].run(t, ["true"], acquire_timeout=30)) for t in later
        ]
        await asyncio.sleep(0.5)  # where the process would have connected, had it
        assert backend.max_alive <= 8, backend.max_alive
        budget._lease = run_lease
        results = [*theirs_ran, *await asyncio.gather(*waiting)]
    assert all(r.ok for r in results)
    assert backend.max_alive <= 8, backend.max_alive
