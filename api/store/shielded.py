"""Transactions a cancelled caller cannot cut in half: the store's rare writes outside the job
writer (webhooks, handles, revocations, drains, `mark_lost`) go through `Transactions`.

A task cancelled inside `async with engine.begin()` (a request whose client went away, a
delivery cut short at shutdown) leaves SQLAlchemy to give the connection up half way: it
"terminates" it, for aiosqlite in a loose task that may never run (measured: half of 40
transactions cancelled in their second statement still held SQLite's write lock when the call
had returned; a restarted API in the same process then failed its migration, "database is
locked"). So each transaction runs whole in a task of its own, awaited through `asyncio.shield`
(asyncpg's pool shields its release the same way): the caller cancelled gets its CancelledError
at once, the transaction commits or rolls back and its connection goes back to the pool. The
store keeps the set in flight and `close` waits for them (bounded) before disposing the engine.

What a transaction took for a caller who is gone can be given back (`abandoned`: the webhook
claims' leases), in a transaction of the same kind."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from api.tasks import TaskSet

log = logging.getLogger("sshapi.store")

T = TypeVar("T")

# Seconds `wait` (the store closing) waits for the transactions in flight: more than SQLite's
# busy timeout (5 s), which one of them may spend waiting for the write lock.
CLOSE_TIMEOUT = 10.0


async def take_turn(conn: AsyncConnection, lock: int, key: str) -> None:
    """Make the transaction on `conn` the only one holding (`lock`, `key`) until it ends, in
    every process: a per-owner cap's count and insert then see the others' rows. Without it,
    12 racing creations against a cap of 3 made 10 (SQLite's driver begins a transaction at
    the INSERT, after the count; PostgreSQL's read committed lets two counts pass at once).
    PostgreSQL: an advisory lock on (`lock`, the key's hash); SQLite: the write lock, now
    (another process waits in the busy timeout)."""
    if conn.dialect.name == "postgresql":
        await conn.execute(
            text("SELECT pg_advisory_xact_lock(:lock, hashtext(:key))"),
            {"lock": lock, "key": key},
        )
    else:
        await conn.exec_driver_sql("BEGIN IMMEDIATE")


class Transactions:
    """The whole transactions of one engine, each in its own task (see the module docstring)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Failures go to their callers (an orphan's are logged here): none is logged twice.
        self._running = TaskSet("store transaction", expected=(Exception,))
        self._orphans: set[asyncio.Task[Any]] = set()  # their caller was cancelled

    def __len__(self) -> int:
        return len(self._running)

    async def run(
        self,
        work: Callable[[AsyncConnection], Awaitable[T]],
        *,
        read: bool = False,
        abandoned: Callable[[T], Awaitable[None]] | None = None,
    ) -> T:
        """`work(conn)` in one transaction (`read`: on a connection without one), to its end
        whatever happens to the caller; `abandoned(result)` runs (as a transaction of its own)
        when the caller was cancelled and the transaction committed."""
        task = self._spawn(self._whole(work, read))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._orphans.add(task)
            if abandoned is not None:  # (at once if it had ended before the caller resumed)
                task.add_done_callback(lambda t: self._abandon(t, abandoned))
            raise

    async def rowcount(self, *statements: Any) -> int:
        """`statements` in one transaction: the last one's count of rows."""

        async def execute(conn: AsyncConnection) -> int:
            count = 0
            for statement in statements:
                count = int((await conn.execute(statement)).rowcount)
            return count

        return await self.run(execute)

    async def _whole(self, work: Callable[[AsyncConnection], Awaitable[T]], read: bool) -> T:
        if read:
            async with self.engine.connect() as conn:
                return await work(conn)
        async with self.engine.begin() as conn:
            return await work(conn)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = self._running.spawn(coro, "store-transaction")
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        orphan = task in self._orphans
        self._orphans.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: never "Task exception was never retrieved"
        if exc is not None and orphan:
            log.warning("a transaction whose caller was cancelled failed", exc_info=exc)

    def _abandon(self, task: asyncio.Task[T], give_back: Callable[[T], Awaitable[None]]) -> None:
        if task.cancelled() or task.exception() is not None:
            return  # rolled back: nothing taken
        # Tracked as the transactions are (`close` waits for it); it opens its own through `run`.
        self._orphans.add(self._spawn(_awaited(give_back(task.result()))))

    async def wait(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Wait for the transactions in flight (and those they start) for up to `timeout`
        seconds; cancel what is left (the engine is disposed next)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self._running) and (left := deadline - loop.time()) > 0:
            await self._running.wait(left)
        if len(self._running):
            log.warning("%d store transaction(s) still running at close: cancelled", len(self))
            await self._running.close()


async def _awaited(coro: Awaitable[T]) -> T:
    return await coro
