"""The job store's one face (`Store`): reads through SQLAlchemy Core, writes through one writer
task with group commit, handed to the dialect's writer (api/store/sqlite.py,
api/store/postgres.py) or, for any other URL, to SQLAlchemy Core.

Group commit: the writes that arrive while a transaction commits go together in the next one,
and each caller's await returns once the transaction holding its write has committed: durable per
call, a burst costs a few commits, and SQLite never sees two writers fight for its lock.

The writer is a task of the process's supervisor (api/tasks.py), handed to `start`: a writer loop
that dies is logged and started again (the queue, and so every caller's write, survives it);
`close` waits for the accepted writes, then stops it.

The schema is not the store's business at run time: `start` has migrate.py upgrade the database
to this release's revision (or, with upgrades off, check it) before anything else."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import (
    Connection,
    Select,
    case,
    delete,
    event,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql.expression import ClauseElement

from api import tracing
from api.states import ACTIVE
from api.store import migrate, outbox, portals
from api.store.portals import Logged, PortalStore, events_of
from api.store.postgres import PgWriter, output_bytes
from api.store.schema import (
    FIELDS,
    JOBS,
    LISTED,
    NODE_DRAINS,
    REVOCATIONS,
    JobRow,
    Revocation,
    Write,
    aware,
    job_row,
    utcnow,
)
from api.store.shielded import Transactions
from api.store.sqlite import Sql, SqliteWriter, sqlite_pragmas
from api.tasks import Child, OnDeath, Supervisor

log = logging.getLogger("sshapi.store")

MAX_BATCH = 256  # writes per transaction: bounds the time one commit holds the lock
_Queued = tuple[Write, int, "asyncio.Future[Any]"]  # a write, the output it carries, its caller
# Told after the commit whose job changed state (None: anyone's): api/live/changes.py.
OnChange = Callable[[tuple[str, str] | None], None]


class Store(PortalStore):
    def __init__(self, url: str, *, schema: str | None = None, upgrade: bool = True) -> None:
        """`upgrade`: bring the schema to this release's revision at start (else only check
        it, and refuse to start when it differs: api/store/migrate.py)."""
        self.url = url
        self.schema = schema
        self.upgrade = upgrade
        self._engine: AsyncEngine | None = None
        self._transactions: Transactions | None = None  # the rare writes, whole (shielded.py)
        self._writes: asyncio.Queue[_Queued] = asyncio.Queue()
        self._tasks: Supervisor | None = None
        self._writer: Child | None = None
        # SQLite only: the writer's DB-API connections (the loop's and its thread's).
        self._sqlite: SqliteWriter | None = None
        self._sql = Sql()
        # PostgreSQL only: the writer's own asyncpg connection.
        self._pg: PgWriter | None = None
        # For /metrics (`write_stats`): a queue that grows says the database is slower than
        # the writes coming in.
        self._pending = 0
        self._commits = 0
        self._committed = 0
        self._commit_seconds = 0.0
        # Called after a committed state change that queued webhook deliveries (the deliverer's
        # wake-up, api/webhooks/deliver.py), so they need not wait for its poll.
        self.on_event: list[Callable[[], None]] = []
        self.on_change: OnChange | None = None

    def _changed(self, owner: tuple[str, str] | None) -> None:
        if self.on_change is not None:
            self.on_change(owner)

    @property
    def dialect(self) -> str:
        return self.url.split(":", 1)[0].split("+", 1)[0]

    async def start(self, tasks: Supervisor) -> None:
        """Open the store, its writer running under `tasks`."""
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if self.dialect == "sqlite":
            path = self.url.split("///", 1)[-1]
            if path and path != ":memory:":
                # Before any connection exists: one blocking mkdir at start is fine.
                Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
        elif self.schema:
            kwargs["connect_args"] = {"server_settings": {"search_path": self.schema}}
        if self.upgrade:
            await migrate.upgrade(self.url, self.schema)
        else:
            await migrate.check(self.url, self.schema)
        engine = create_async_engine(self.url, **kwargs)
        if self.dialect == "sqlite":
            event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        self._engine, self._transactions = engine, Transactions(engine)
        if self.dialect == "postgresql":
            self._pg = PgWriter(self.url, self.schema)
        if self.dialect == "sqlite":
            self._sqlite = SqliteWriter(make_url(self.url).database or ":memory:")
            await self._sqlite.start()
        self._tasks = tasks
        self._writer = tasks.spawn("store-writer", self._write_loop, OnDeath.RESTART)

    async def close(self) -> None:
        if self._writer is not None and self._tasks is not None:
            task = self._writer.task
            if task is not None and not task.done():  # else nothing would ever commit them
                await self._writes.join()  # every accepted write is committed (or failed) first
            await self._tasks.stop(self._writer)
            self._writer = None
        if self._sqlite is not None:
            await self._sqlite.close()
            self._sqlite = None
        if self._pg is not None:
            await self._pg.close()
            self._pg = None
        if self._transactions is not None:  # cancelled callers' transactions end first
            await self._transactions.wait()
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    @property
    def transactions(self) -> Transactions:
        """For the writes outside the job writer, here and in api/store/webhooks.py."""
        if self._transactions is None:
            raise RuntimeError("store not started")
        return self._transactions

    def _started(self) -> AsyncEngine:
        """The engine, for reads and the rare statements outside the writer (mark_lost)."""
        if self._engine is None:
            raise RuntimeError("store not started")
        return self._engine

    async def _rows(self, query: Select[Any]) -> list[JobRow]:
        async with self._started().connect() as conn:
            return [job_row(r) for r in await conn.execute(query)]

    async def _one(self, query: Select[Any]) -> JobRow | None:
        rows = await self._rows(query)
        return rows[0] if rows else None

    async def ping(self) -> None:
        async with self._started().connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def _write(self, write: Write, size: int = 0) -> Any:
        """Queue a write for the writer; returns its result once its transaction committed.
        `size`: the job output it carries, in bytes."""
        if self._writer is None or self._tasks is None or not self._tasks.healthy:
            raise RuntimeError("store not started, or its writer is gone")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._writes.put_nowait((write, size, done))
        self._pending += 1
        return await done

    def write_stats(self) -> dict[str, float]:
        """Writes accepted and not yet committed (waiting or in the transaction under way),
        transactions and writes committed, and the seconds those transactions took."""
        return {
            "pending": self._pending,
            "commits": self._commits,
            "writes": self._committed,
            "commit_seconds": self._commit_seconds,
        }

    async def _write_loop(self) -> None:
        while True:
            batch = [await self._writes.get()]
            while len(batch) < MAX_BATCH and not self._writes.empty():
                batch.append(self._writes.get_nowait())
            start = time.perf_counter()
            try:
                await self._commit(batch)
            except Exception:
                # One bad write (a duplicate idempotency key) must not fail the others: apply
                # each in its own transaction so that only it gets the error.
                for item in batch:
                    with contextlib.suppress(Exception):
                        await self._commit([item])
            finally:
                self._commits += 1
                self._committed += len(batch)
                self._pending -= len(batch)
                self._commit_seconds += time.perf_counter() - start
                for _ in batch:
                    self._writes.task_done()
            if self._sqlite is not None:
                await self._sqlite.checkpoint_if_due()

    async def _commit(self, batch: list[_Queued]) -> None:
        """Apply `batch` in one transaction; results (or, for a batch of one, the error) go to
        the callers only after the commit."""
        try:
            results = await self._transaction(
                [write for write, _, _ in batch], sum(size for _, size, _ in batch)
            )
        except Exception as exc:
            if len(batch) == 1 and not batch[0][2].done():
                batch[0][2].set_exception(exc)
            raise
        for (_, _, done), result in zip(batch, results, strict=True):
            if not done.done():  # the caller may have been cancelled meanwhile
                done.set_result(result)

    async def _transaction(self, writes: list[Write], size: int) -> list[Any]:
        if self._sqlite is not None:
            return await self._sqlite.transaction(writes, size)
        if self._pg is not None:
            return await self._pg.transaction(writes)
        if self._engine is None:
            raise RuntimeError("store not started")
        async with self._engine.begin() as conn:
            return await conn.run_sync(lambda c: [write(c) for write in writes])

    async def insert(self, row: JobRow) -> JobRow:
        """Insert a job; IntegrityError on a duplicate (owner, idempotency key)."""

        # None is left out, so that the columns' defaults apply as in a Core insert.
        values = {k: v for k in FIELDS if (v := getattr(row, k)) is not None}
        add: Write
        size = 0  # the output it carries: SQLite writes a large one off the event loop
        if self._sqlite is not None:
            values = self._sql.with_defaults(values)
            sql, params = self._sql.insert(tuple(values)), self._sql.params(values)
            size = output_bytes(params)

            event = [row.owner_iss, row.owner_sub, row.id, row.state, *self._sql.now()]

            def add(db: sqlite3.Connection) -> None:
                try:
                    db.execute(sql, params)
                except sqlite3.IntegrityError as exc:
                    # The same exception as from SQLAlchemy: callers catch one kind.
                    raise IntegrityError(sql, params, exc) from None
                db.execute(portals.SQLITE_EVENT_VALUES, event)
        elif self._pg is not None:
            pg = self._pg.sql
            values = pg.with_defaults(values)
            sql, params = pg.insert(tuple(values)), pg.params(values)

            pg_event = [row.owner_iss, row.owner_sub, row.id, row.state, *pg.now()]

            async def add(conn: asyncpg.Connection) -> None:
                try:
                    await conn.execute(sql, *params)
                except asyncpg.UniqueViolationError as exc:
                    raise IntegrityError(sql, params, exc) from None
                await conn.execute(portals.PG_EVENT_VALUES, *pg_event)
        else:

            def add(conn: Connection) -> None:
                conn.execute(insert(JOBS).values(values))
                conn.execute(events_of(JOBS.c.id == row.id))

        with tracing.store_span("INSERT", self.dialect):
            await self._write(Logged(add), size)
        self._changed((row.owner_iss, row.owner_sub))
        return row

    async def get(self, job_id: str) -> JobRow | None:
        return await self._one(select(JOBS).where(JOBS.c.id == job_id))

    async def summary(self, job_id: str) -> JobRow | None:
        """A job without its output columns (as a list reads it): a webhook's `data`."""
        return await self._one(select(*LISTED).where(JOBS.c.id == job_id))

    async def by_key(self, iss: str, sub: str, key: str) -> JobRow | None:
        c = JOBS.c
        return await self._one(
            select(JOBS).where(c.owner_iss == iss, c.owner_sub == sub, c.idempotency_key == key)
        )

    async def update(
        self,
        job_id: str,
        *,
        only_active: bool = False,
        unless_cancel_requested: bool = False,
        **values: Any,
    ) -> bool:
        """Set columns of one job; with only_active, only while it is queued or running (so a
        late writer never overwrites a final state); with unless_cancel_requested, only while
        no other replica asked to cancel it. True if a row changed. A change of `state` queues
        the owner's webhook deliveries of it in the same transaction (api/store/outbox.py)."""
        deliveries = outbox.params(job_id, values)
        logged = "state" in values  # a job event too (api/store/portals.py)
        queued = [False]  # a delivery queued: only then wake the deliverer (it reads the outbox)
        if self._sqlite is not None:
            exprs = {k: v for k, v in values.items() if isinstance(v, ClauseElement)}
            if exprs:  # rare: built per call, not cached
                sql, params = self._update_with_expressions(
                    job_id, values, exprs, only_active, unless_cancel_requested
                )
            else:
                sql = self._sql.update(tuple(values), only_active, unless_cancel_requested)
                params = [*self._sql.params(values), job_id]

            event = [*self._sql.now(), job_id] if logged else []

            def run(db: sqlite3.Connection) -> Any:
                if db.execute(sql, params).rowcount == 0:
                    return False
                if deliveries is not None:
                    queued[0] = db.execute(outbox.SQLITE, deliveries).rowcount > 0
                if logged:  # the job event (its owner: whose change feed to wake)
                    return tuple(db.execute(portals.SQLITE_EVENT_FROM_ROW, event).fetchall()[0])
                return True

            write: Write = Logged(run) if logged else run
            with tracing.store_span("UPDATE", self.dialect):
                result = await self._write(write, output_bytes(params))
            return self._evented(self._logged(result), queued[0])
        if self._pg is not None:
            pg = self._pg.sql
            if any(isinstance(v, ClauseElement) for v in values.values()):  # rare: per call
                sets, params = pg.expression(update(JOBS).values(**values))
                params.append(job_id)
                sql = f"{sets} {pg.where(f'${len(params)}', only_active, unless_cancel_requested)}"
            else:
                sql = pg.update(tuple(values), only_active, unless_cancel_requested)
                params = [*pg.params(values), job_id]

            pg_event = [*pg.now(), job_id] if logged else []

            async def change(conn: asyncpg.Connection) -> Any:
                status: str = await conn.execute(sql, *params)  # "UPDATE <rows>"
                if status.rsplit(" ", 1)[-1] == "0":
                    return False
                if deliveries is not None:
                    inserted: str = await conn.execute(outbox.POSTGRES, *deliveries)
                    queued[0] = inserted.rsplit(" ", 1)[-1] != "0"  # "INSERT 0 <rows>"
                if logged:
                    return tuple(await conn.fetchrow(portals.PG_EVENT_FROM_ROW, *pg_event))
                return True

            pg_write: Write = Logged(change) if logged else change
            with tracing.store_span("UPDATE", self.dialect):
                result = await self._write(pg_write)
            return self._evented(self._logged(result), queued[0])
        query = update(JOBS).where(JOBS.c.id == job_id).values(**values)
        if only_active:
            query = query.where(JOBS.c.state.in_(ACTIVE))
        if unless_cancel_requested:
            query = query.where(JOBS.c.cancel_requested.is_(None))

        def execute(conn: Connection) -> bool:
            changed = bool(conn.execute(query).rowcount)
            if changed and deliveries is not None:
                found = conn.execute(text(outbox.CORE), outbox.core_params(deliveries))
                queued[0] = found.rowcount > 0
            if changed and logged:
                conn.execute(events_of(JOBS.c.id == job_id))
            return changed

        changed = bool(await self._write(Logged(execute) if logged else execute))
        if changed and logged:
            self._changed(None)
        return self._evented(changed, queued[0])

    def _logged(self, result: Any) -> bool:
        """An update's result: False, True, or (logged) the owner whose feed to wake."""
        if isinstance(result, tuple):
            self._changed((result[0], result[1]))
            return True
        return bool(result)

    def _evented(self, changed: bool, queued: bool) -> bool:
        if changed and queued:
            for listener in self.on_event:
                listener()
        return changed

    def _update_with_expressions(
        self,
        job_id: str,
        values: dict[str, Any],
        exprs: dict[str, ClauseElement],
        only_active: bool,
        unless_cancel: bool,
    ) -> tuple[str, list[Any]]:
        sets, params = [], []
        for key, value in values.items():
            if key in exprs:
                text_, more = self._sql.expression(exprs[key])
                sets.append(f"{key} = {text_}")
                params += more
            else:
                sets.append(f"{key} = ?")
                params += self._sql.params({key: value})
        template = self._sql.update(("__sets__",), only_active, unless_cancel)
        sql = template.replace("__sets__ = ?", ", ".join(sets))
        return sql, [*params, job_id]

    async def list_jobs(
        self,
        *,
        owner: tuple[str, str] | None,
        state: str | None,
        host: str | None,
        limit: int,
        before: str | None,
    ) -> list[JobRow]:
        """Newest first; `before` is the id of the last job of the previous page. Without the
        output columns (up to the policy's max_output each): a list never carries them, so a
        listed row's stdout and stderr are empty whatever the job wrote."""
        c = JOBS.c
        query = select(*LISTED).order_by(c.id.desc()).limit(limit)
        if owner is not None:
            query = query.where(c.owner_iss == owner[0], c.owner_sub == owner[1])
        if state is not None:
            query = query.where(c.state == state)
        if host is not None:
            query = query.where(c.host == host)
        if before is not None:
            query = query.where(c.id < before)
        return await self._rows(query)

    async def mark_lost(self, replica: str) -> int:
        """Commands this replica left queued or running when it died: their outcome is unknown,
        except those another replica cancelled (and killed) meanwhile. Batch jobs are not
        touched: the scheduler still knows them (see `active_batch`)."""
        c = JOBS.c
        cancelled = c.cancel_requested.is_not(None)
        query = (
            update(JOBS)
            .where(c.replica == replica, c.state.in_(ACTIVE))
            .where(or_(c.kind.is_(None), c.kind != "batch"))
            .values(
                state=case((cancelled, "cancelled"), else_="lost"),
                error=case(
                    (cancelled, c.cancel_requested),
                    else_="the API restarted while the job was active",
                ),
                finished_at=utcnow(),
            )
        )
        found = (
            select(c.id, c.cancel_requested)
            .where(c.replica == replica, c.state.in_(ACTIVE))
            .where(or_(c.kind.is_(None), c.kind != "batch"))
        )

        async def lose(conn: AsyncConnection) -> tuple[list[Any], int]:
            if conn.dialect.name == "postgresql":  # first: events commit in seq order
                await conn.execute(text(f"SELECT pg_advisory_xact_lock({portals.EVENTS_LOCK})"))
            # The jobs first, so that their webhook deliveries commit with their new state.
            rows = list((await conn.execute(found)).all())
            result = await conn.execute(query)
            for row in rows:
                state = "cancelled" if row.cancel_requested is not None else "lost"
                deliveries = outbox.event_params(row.id, state)
                await conn.execute(text(outbox.CORE), outbox.core_params(deliveries))
            if rows:
                await conn.execute(events_of(c.id.in_([row.id for row in rows])))
            return rows, int(result.rowcount)

        rows, lost = await self.transactions.run(lose)
        if rows:
            self._evented(True, True)
            self._changed(None)
        return lost

    async def active_batch(self, replica: str) -> list[JobRow]:
        """Batch jobs of this replica not final yet: tracked again (or resolved) on start."""
        c = JOBS.c
        return await self._rows(
            select(JOBS).where(c.replica == replica, c.kind == "batch", c.state.in_(ACTIVE))
        )

    # ---- revocations (rare writes: outside the job writer, one statement each)

    async def revoke(self, revocation: Revocation) -> None:
        await self.transactions.rowcount(insert(REVOCATIONS).values(**_fields(revocation)))

    async def revocations(self) -> list[Revocation]:
        """Every revocation, oldest first."""
        query = select(REVOCATIONS).order_by(REVOCATIONS.c.id)
        async with self._started().connect() as conn:
            rows = [dict(r._mapping) for r in await conn.execute(query)]
        for row in rows:
            row["created_at"] = aware(row["created_at"])
        return [Revocation(**row) for row in rows]

    async def lift(self, revocation_id: str) -> bool:
        """Delete a revocation; False when there is none of that id."""
        query = delete(REVOCATIONS).where(REVOCATIONS.c.id == revocation_id)
        return bool(await self.transactions.rowcount(query))

    async def active_of(self, owner: tuple[str, str] | None, account: str | None) -> list[JobRow]:
        """Active jobs of an identity, or run as an account (their target is `account@...`)."""
        query = select(*LISTED).where(JOBS.c.state.in_(ACTIVE), *_of(owner, account))
        return await self._rows(query)

    async def seen(self, owner: tuple[str, str] | None, account: str | None) -> bool:
        """Whether the store holds any job (in any state, within its retention) of an
        identity, or run as an account."""
        query = select(JOBS.c.id).where(*_of(owner, account)).limit(1)
        async with self._started().connect() as conn:
            return (await conn.execute(query)).first() is not None

    # ---- drained login nodes (rare writes: outside the job writer, one statement each)

    async def drain(self, host: str, node: str, by: tuple[str, str]) -> None:
        """Record `node` of `host` as drained (again: kept as first drained)."""
        values = {"host": host, "node": node, "drained_at": utcnow()}
        values |= {"drained_by_iss": by[0], "drained_by_sub": by[1]}
        query = select(NODE_DRAINS.c.host).where(
            NODE_DRAINS.c.host == host, NODE_DRAINS.c.node == node
        )

        async def add(conn: AsyncConnection) -> None:
            if (await conn.execute(query)).first() is None:
                with contextlib.suppress(IntegrityError):  # another replica, just now
                    async with conn.begin_nested():
                        await conn.execute(insert(NODE_DRAINS).values(**values))

        await self.transactions.run(add)

    async def undrain(self, host: str, node: str) -> None:
        query = delete(NODE_DRAINS).where(NODE_DRAINS.c.host == host, NODE_DRAINS.c.node == node)
        await self.transactions.rowcount(query)

    async def drained(self) -> set[tuple[str, str]]:
        """Every drained (host, node)."""
        query = select(NODE_DRAINS.c.host, NODE_DRAINS.c.node)
        async with self._started().connect() as conn:
            return {(r.host, r.node) for r in await conn.execute(query)}


def _of(owner: tuple[str, str] | None, account: str | None) -> list[Any]:
    """The conditions on JOBS of an identity's jobs, or of those run as an account."""
    c = JOBS.c
    conditions: list[Any] = []
    if owner is not None:
        conditions += [c.owner_iss == owner[0], c.owner_sub == owner[1]]
    if account is not None:
        conditions.append(c.target.startswith(f"{account}@", autoescape=True))
    return conditions


def _fields(revocation: Revocation) -> dict[str, Any]:
    return {name: getattr(revocation, name) for name in REVOCATIONS.c.keys()}  # noqa: SIM118
