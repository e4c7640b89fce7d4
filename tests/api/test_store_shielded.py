"""A caller cancelled in the middle of one of the store's transactions outside the job writer
(api/store/shielded.py) cannot cut it in half: on SQLite the write lock is free once the call
has returned and the transactions in flight have ended (or the store has closed), on PostgreSQL
no connection is left idle in a transaction, and the rows are all written or none."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.engine import make_url
from test_api_store import job
from test_api_webhook_store import hook

from api.store import Delivery, Store, WebhookStore
from api.store.schema import WEBHOOK_DELIVERIES, WEBHOOKS
from api.tasks import Supervisor

ROUNDS = 50


class Barrier:
    """Set once the store's connection has sent an UPDATE of webhook_deliveries (the first
    statement of `record`: on SQLite it holds the write lock from then on). Records the
    PostgreSQL backends the store used."""

    def __init__(self, store: Store) -> None:
        self.sent = asyncio.Event()
        self.pids: set[int] = set()
        self.engine = store.transactions.engine.sync_engine
        event.listen(self.engine, "after_cursor_execute", self._after)

    def _after(self, conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if self.engine.dialect.name == "postgresql":
            self.pids.add(conn.connection.driver_connection.get_server_pid())
        if statement.lstrip().startswith(f"UPDATE {WEBHOOK_DELIVERIES.name} "):
            self.sent.set()

    def remove(self) -> None:
        event.remove(self.engine, "after_cursor_execute", self._after)


async def claimed(store: Store, hooks: WebhookStore, hook_id: str) -> Delivery:
    """A fresh delivery of `hook_id`'s owner, claimed by replica "a"."""
    row = await store.insert(job())
    assert await store.update(row.id, only_active=True, state="succeeded")
    now = time.time() + 1
    [(delivery_id, _, _)] = [d for d in await hooks.due(now, 100) if d[2] == "alice"]
    [delivery] = await hooks.claim([delivery_id], now, 30, "a")
    assert delivery.webhook_id == hook_id
    return delivery


async def cancel_mid_record(
    hooks: WebhookStore, barrier: Barrier, delivery: Delivery, i: int
) -> None:
    """`record` the delivery delivered, and cancel it once its first UPDATE was sent (a few
    loop turns later, every other round twice, as a shutdown's cancels come)."""
    barrier.sent.clear()
    now = time.time()
    task = asyncio.create_task(
        hooks.record(
            delivery, "a", status="delivered", now=now, next_at=now, http_status=204, error=None
        )
    )
    sent = asyncio.ensure_future(barrier.sent.wait())
    await asyncio.wait([task, sent], return_when=asyncio.FIRST_COMPLETED)
    assert barrier.sent.is_set(), "record returned before its first UPDATE was sent"
    sent.cancel()
    for _ in range(i % 4):
        await asyncio.sleep(0)
    task.cancel()
    if i % 2:
        await asyncio.sleep(0)
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def all_or_none(store: Store, delivery: Delivery, delivered_before: int) -> int:
    """The delivery's row and its webhook's count agree (both written or neither); the count."""
    d, w = WEBHOOK_DELIVERIES.c, WEBHOOKS.c
    async with store.transactions.engine.connect() as conn:
        status = (await conn.execute(select(d.status).where(d.id == delivery.id))).scalar_one()
        count = (
            await conn.execute(select(w.delivered).where(w.id == delivery.webhook_id))
        ).scalar_one()
    assert (status, count) in {("delivered", delivered_before + 1), ("pending", delivered_before)}
    return int(count)


async def assert_unlocked(store_url: str, pids: set[int], admin: Store | None) -> None:
    """SQLite: another connection gets the write lock at once. PostgreSQL: none of the store's
    backends is idle in a transaction."""
    if store_url.startswith("sqlite"):
        db = sqlite3.connect(make_url(store_url).database or "", timeout=0)
        try:
            db.execute("BEGIN IMMEDIATE")  # raises "database is locked" if anyone holds it
            db.execute("ROLLBACK")
        finally:
            db.close()
        return
    assert admin is not None
    query = text("SELECT pid, state FROM pg_stat_activity WHERE pid = ANY(:pids)")
    async with admin.transactions.engine.connect() as conn:
        states = {r.pid: r.state for r in await conn.execute(query, {"pids": list(pids)})}
    assert not [
        pid for pid, state in states.items() if (state or "").startswith("idle in transaction")
    ], states


async def test_a_write_cancelled_mid_transaction_commits_or_rolls_back_whole(store: Store) -> None:
    hooks = WebhookStore(store.transactions)
    alices = hook("alice", ["job.succeeded"])
    assert await hooks.create(alices, limit=10)
    barrier = Barrier(store)
    delivered = 0
    try:
        for i in range(ROUNDS):
            delivery = await claimed(store, hooks, alices.id)
            await cancel_mid_record(hooks, barrier, delivery, i)
            await store.transactions.wait()  # what `Store.close` waits for
            await assert_unlocked(store.url, barrier.pids, store)
            delivered = await all_or_none(store, delivery, delivered)
    finally:
        barrier.remove()
    assert barrier.pids or store.dialect == "sqlite"


async def test_a_store_closed_right_after_a_cancelled_write_leaves_nothing_locked(
    store: Store, tasks: Supervisor
) -> None:
    """The shutdown's order: the caller cancelled, its store closed at once; the database is
    free and the rows whole for the next store (the API started again in the same process)."""
    alices = hook("alice", ["job.succeeded"])
    assert await WebhookStore(store.transactions).create(alices, limit=10)
    delivered = 0
    for i in range(ROUNDS // 5):
        current = Store(store.url, schema=store.schema)
        await current.start(tasks)
        try:
            hooks = WebhookStore(current.transactions)
            barrier = Barrier(current)
            delivery = await claimed(current, hooks, alices.id)
            await cancel_mid_record(hooks, barrier, delivery, i)
        finally:
            await current.close()
        await assert_unlocked(store.url, barrier.pids, store)
        delivered = await all_or_none(store, delivery, delivered)


async def test_a_claim_whose_caller_is_cancelled_gives_its_leases_back(store: Store) -> None:
    """The deliverer stopped in the middle of a claim: the claim commits or not, and if it did
    the leases are given back, so the next process sends the deliveries at once (not after
    their leases run out)."""
    hooks = WebhookStore(store.transactions)
    alices = hook("alice", ["job.succeeded"])
    assert await hooks.create(alices, limit=10)
    barrier = Barrier(store)
    d = WEBHOOK_DELIVERIES.c
    try:
        for i in range(ROUNDS // 5):
            row = await store.insert(job())
            assert await store.update(row.id, only_active=True, state="succeeded")
            now = time.time() + 1
            ids = [delivery_id for delivery_id, _, _ in await hooks.due(now, 100)]
            assert len(ids) == 1
            barrier.sent.clear()
            task = asyncio.create_task(hooks.claim(ids, now, 30, "a"))
            sent = asyncio.ensure_future(barrier.sent.wait())
            await asyncio.wait([task, sent], return_when=asyncio.FIRST_COMPLETED)
            assert barrier.sent.is_set()
            sent.cancel()
            for _ in range(i % 4):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await store.transactions.wait()
            await assert_unlocked(store.url, barrier.pids, store)
            assert [x for x, _, _ in await hooks.due(now, 100)] == ids  # free again
            async with store.transactions.engine.connect() as conn:
                query = select(d.attempts, d.lease_by).where(d.id == ids[0])
                assert tuple((await conn.execute(query)).one()) == (0, None)
            # Delivered, so that the next round's due holds only its own.
            [claimed_now] = await hooks.claim(ids, now, 30, "a")
            assert await hooks.record(
                claimed_now,
                "a",
                status="delivered",
                now=now,
                next_at=now,
                http_status=204,
                error=None,
            )
    finally:
        barrier.remove()
