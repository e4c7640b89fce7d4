"""One sshd, many accounts, for real: the rig's researcher accounts (real Unix accounts, each
with its own key) on one stock sshd run as root. The pool's per-sshd budget holds sshd's limits
over all of them (the fake-backend logic: test_budget.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from sshpool import Limits, Pool
from sshpool.devhost.accounts import ensure_accounts
from sshpool.devhost.host import LocalHost

MakeHost = Callable[..., LocalHost]  # the make_host fixture (tests/conftest.py)


async def test_forty_accounts_at_once_stay_within_the_sshds_budget(
    make_host: MakeHost, tmp_path: Path
) -> None:
    """40 accounts, one command each at once, room for 12 connections: every command runs as
    its own account, sshd logs no drop, never more than 12 connections (24 sshd processes)."""
    accounts = ensure_accounts(40, data_dir=tmp_path)
    host = make_host("stock", researchers=True)
    lim = Limits(max_total_connections=12)
    targets = [dataclasses.replace(a.target(host), limits=lim) for a in accounts]
    most = 0
    async with Pool() as pool:

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, sum(s["connections"] for s in pool.stats().values()))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(
            *(pool.run(t, ["id", "-un"], timeout=30, acquire_timeout=30) for t in targets)
        )
        watcher.cancel()
        stats = pool.sshd_stats()[f"{host.address}:{host.port}"]
    assert [r.stdout.decode().strip() for r in results] == [a.name for a in accounts]
    assert "drop connection" not in host.log_path.read_text()
    assert most <= 12 and stats["connections_max"] <= 12
    assert stats["counters"]["evictions"] >= 40 - 12
