"""Several processes sharing one sshd's budget (sshpool/budget.py `Coordinator`), on the fake
backend: the static share keeps their sum within the budget and the gate, and a share lowered
under what a process holds closes its idle connections and makes busy ones yield, without
failing a command. Shares leased from Redis: tests/api/test_sshd_budget.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sshpool import Limits, Pool, StaticShare, Target, static_share
from sshpool.devhost import FakeBackend


def account(i: int, **limits: object) -> Target:
    return Target("fake", f"user{i}", ("key",), "known_hosts", limits=Limits(**limits))  # type: ignore[arg-type]


def test_the_static_share_is_the_budget_over_processes_at_least_one() -> None:
    assert [static_share(64, n) for n in (1, 2, 3, 4, 64, 100)] == [64, 32, 21, 16, 1, 1]
    assert [static_share(6, n) for n in (1, 2, 4, 7)] == [6, 3, 1, 1]


async def test_two_processes_with_static_shares_stay_within_one_sshds_budget() -> None:
    """Two pools (two API processes) on one sshd, budget 8 and gate 6, 40 accounts each at
    once: never more than 8 connections nor 6 handshakes in all (each keeps 4 and 3), and
    every command runs. Each with the whole budget, they would hold 16."""
    backend = FakeBackend(connect_time=0.01)
    pools = [Pool(backend, coordinator=StaticShare(2)) for _ in range(2)]
    lim = {"max_total_connections": 8, "max_handshakes": 6}
    try:
        results = await asyncio.gather(
            *(p.run(account(i, **lim), ["true"]) for p in pools for i in range(40))
        )
        stats = [p.sshd_stats()["fake:22"] for p in pools]
    finally:
        for p in pools:
            await p.close()
    assert all(r.ok for r in results)
    assert backend.max_alive <= 8 and backend.max_in_flight <= 6
    assert [(s["share_connections"], s["share_handshakes"]) for s in stats] == [(4, 3), (4, 3)]
    assert all(s["connections_max"] <= 4 for s in stats)


def alive(backend: FakeBackend) -> int:
    return sum(1 for c in backend.conns if c.alive)


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110 (an outside condition: nothing to await)
            await asyncio.sleep(0.01)


async def test_a_lowered_share_closes_idle_connections_and_busy_ones_yield() -> None:
    """A process holds 8 connections, 3 of them running a command, when its share drops to
    2: the idle ones close at once, the busy ones as their commands end (which all succeed),
    and it keeps within 2 from then on."""
    backend = FakeBackend(connect_time=0.01, exec_time=0.01)
    targets = [account(i, max_total_connections=8) for i in range(8)]
    async with Pool(backend) as pool:
        await asyncio.gather(*(pool.run(t, ["true"]) for t in targets))
        assert alive(backend) == 8
        backend.exec_time = 5.0
        busy = [asyncio.create_task(pool.run(t, ["sleep"])) for t in targets[:3]]
        await until(lambda: pool.sshd_stats()["fake:22"]["connections_busy"] == 3)
        next(iter(pool._sshds.values())).allow(6, 2)
        await until(lambda: alive(backend) == 3)  # the three busy ones, not yet ended
        assert not any(t.done() for t in busy)
        results = await asyncio.gather(*busy)
        await until(lambda: alive(backend) <= 2)
        backend.exec_time = 0.01
        backend.max_alive = 0
        more = await asyncio.gather(*(pool.run(t, ["true"]) for t in targets))
        stats = pool.sshd_stats()["fake:22"]
    assert all(r.ok for r in results + more)
    assert backend.max_alive <= 2
    assert stats["share_connections"] == 2 and stats["connections_busy"] == 0
    assert stats["connections_idle"] + stats["connections_closing"] <= 2
