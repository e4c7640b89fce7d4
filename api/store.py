"""The job store: SQLAlchemy 2 async over SQLite (WAL, the default) or PostgreSQL (by URL).

Tables are created on start (`create_all`), and columns added since are added then too (`ALTER
TABLE ... ADD COLUMN`, all of them nullable): the schema only grows, so that is the whole migration
story and an older database keeps working. Job ids are UUIDv7, so ordering by id is ordering by
creation time and the list cursor is simply the last id seen.

Writes go through one writer task with group commit: whatever insert and update calls arrive
while a transaction commits are applied together in the next one, and each caller's await
returns only once the transaction holding its write has committed. So durability is per call as
before, but a burst of jobs costs a few commits instead of one each, and SQLite never sees two
writers fighting for its lock (which made the losers sleep in its busy handler for seconds).
On SQLite the writer runs each whole transaction on a plain sqlite3 connection with SQL text
built once per statement shape (`_Sql`), on the event loop itself unless it would block it
(`_SqliteWriter`): through aiosqlite every statement, cursor, ping and commit was a thread hop
with a GIL handoff (about 12 per job, 4-5 ms of CPU per job on this box), even one hop per
transaction cost a burst tens of milliseconds per commit, and building a Core statement per
write (cache key, coercions) cost about as much as running it. Values go through the columns'
own SQLAlchemy bind processors, so what the writer stores reads back through Core exactly as
what SQLAlchemy itself writes. Rows are read with Core into plain `JobRow` records (no ORM).
PostgreSQL needs no thread: the writer keeps its own asyncpg connection on the event loop and
runs the same statement shapes as text with `$n` parameters, each prepared once per connection
by asyncpg's statement cache (`_PgWriter`); reads still go through SQLAlchemy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sqlite3
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, cast

import asyncpg
from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Connection,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Row,
    Select,
    String,
    Table,
    Text,
    UniqueConstraint,
    case,
    event,
    insert,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection, Dialect
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from api.states import ACTIVE

log = logging.getLogger("sshapi.store")

MAX_BATCH = 256  # writes per transaction: bounds the time one commit holds the lock
SCHEMA_ATTEMPTS = 3  # creating the tables on start, against another process doing the same


def new_id() -> str:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then random bits. Sorts by creation."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(secrets.token_bytes(10), "big")
    value = (ms & (2**48 - 1)) << 80 | rand
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return str(uuid.UUID(int=value))


def utcnow() -> datetime:
    return datetime.now(UTC)


METADATA = MetaData()

JOBS = Table(
    "sshapi_jobs",
    METADATA,
    Column("id", String(36), primary_key=True),
    Column("owner_iss", String(512), nullable=False),
    Column("owner_sub", String(512), nullable=False),
    Column("replica", String(255), nullable=False),
    Column("host", String(64), nullable=False),
    # user@host:port the command ran as (the policy's account), for operators.
    Column("target", String(512), nullable=False),
    Column("argv", JSON, nullable=True),
    Column("command", Text, nullable=True),
    Column("template", String(64), nullable=True),
    Column("params", JSON, nullable=True),
    Column("timeout", Float, nullable=False),
    Column("state", String(16), nullable=False),
    Column("error", Text, nullable=True),
    Column("error_kind", String(64), nullable=True),
    Column("exit_status", Integer, nullable=True),
    Column("exit_signal", String(32), nullable=True),
    Column("stdout", LargeBinary, nullable=False, default=b""),
    Column("stderr", LargeBinary, nullable=False, default=b""),
    Column("stdout_bytes", Integer, nullable=False, default=0),
    Column("stderr_bytes", Integer, nullable=False, default=0),
    Column("stdout_truncated", Boolean, nullable=False, default=False),
    Column("stderr_truncated", Boolean, nullable=False, default=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=True),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    # Milliseconds per stage: queue, connect, open, exec.
    Column("timings", JSON, nullable=False, default=dict),
    Column("idempotency_key", String(255), nullable=True),
    Column("request_hash", String(64), nullable=True),
    # Batch jobs (kind "batch"): the request's script and options, and the scheduler's view. NULL
    # kind is "command" (rows written before batch jobs existed).
    Column("kind", String(16), nullable=True),
    Column("batch", JSON(none_as_null=True), nullable=True),
    Column("scheduler_job_id", String(32), nullable=True),
    Column("scheduler_state", String(64), nullable=True),
    Column("scheduler_reason", Text, nullable=True),
    # The remote process group of a started command (the wrapper's `$$`), so that any replica
    # can kill it; and why a replica other than the owner asked to cancel it.
    Column("pgid", Integer, nullable=True),
    Column("cancel_requested", Text, nullable=True),
    UniqueConstraint("owner_iss", "owner_sub", "idempotency_key", name="sshapi_jobs_idem"),
    Index("sshapi_jobs_owner", "owner_iss", "owner_sub", "id"),
    Index("sshapi_jobs_replica_state", "replica", "state"),
)


@dataclass(slots=True, kw_only=True)
class JobRow:
    """One job as the service holds it: a row of JOBS as a plain record. Not an ORM-mapped
    class: SQLAlchemy's attribute instrumentation (a descriptor call and an event check on every
    read and write, about 140 per job) was 10% of the API's Python calls per job. The store reads
    rows with Core and builds these from them; writes are statements (`Store.update`), so a
    field set here changes only this copy."""

    id: str
    owner_iss: str
    owner_sub: str
    replica: str
    host: str
    target: str
    timeout: float
    state: str
    created_at: datetime
    argv: list[str] | None = None
    command: str | None = None
    template: str | None = None
    params: dict[str, Any] | None = None
    error: str | None = None
    error_kind: str | None = None
    exit_status: int | None = None
    exit_signal: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    started_at: datetime | None = None
    finished_at: datetime | None = None
    timings: dict[str, float] = field(default_factory=dict)
    idempotency_key: str | None = None
    request_hash: str | None = None
    kind: str | None = None
    batch: dict[str, Any] | None = None
    scheduler_job_id: str | None = None
    scheduler_state: str | None = None
    scheduler_reason: str | None = None
    pgid: int | None = None
    cancel_requested: str | None = None


FIELDS = tuple(c.key for c in JOBS.columns)
# What a list selects: never the output columns (up to the policy's max_output each).
LISTED = [c for c in JOBS.columns if c.key not in ("stdout", "stderr")]


def _job(row: Row[Any]) -> JobRow:
    return JobRow(**row._mapping)


def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_conn.cursor()
    # WAL: readers never block the writer; NORMAL sync is durable across process crashes (the
    # WAL is fsynced at checkpoints; a power loss can drop the last commits).
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


# Writes are DB-API calls on the writer's sqlite3 connection (SQLite), text statements on its
# asyncpg connection (PostgreSQL) or Core statements (any other URL): building a statement per
# write cost about as much CPU as running it (py-spy).
Write = Callable[[Any], Any]
_Queued = tuple[Write, int, "asyncio.Future[Any]"]  # a write, the output it carries, its caller
ACTIVE_SQL = ", ".join(f"'{state}'" for state in sorted(ACTIVE))


class _Sql:
    """SQLite statements as DB-API text, one per shape (which columns, which conditions), built
    once; values converted by each column's bind processor (JSON, DateTime, Boolean)."""

    def __init__(self, dialect: Dialect | None = None) -> None:
        self.dialect = dialect = dialect or sqlite_dialect.dialect()
        self.process = {
            c.key: c.type.dialect_impl(dialect).bind_processor(dialect) for c in JOBS.columns
        }
        self.cache: dict[tuple[Any, ...], str] = {}
        # Column defaults as SQLAlchemy would apply them on insert (`default=0`, `default=dict`).
        # A callable one takes SQLAlchemy's execution context, which it ignores here.
        self.defaults: dict[str, tuple[bool, Any]] = {
            c.key: (bool(c.default.is_callable), getattr(c.default, "arg", None))
            for c in JOBS.columns
            if c.default is not None and (c.default.is_scalar or c.default.is_callable)
        }

    def with_defaults(self, values: dict[str, Any]) -> dict[str, Any]:
        for key, (is_callable, arg) in self.defaults.items():
            if key not in values:
                values[key] = arg(None) if is_callable else arg
        return values

    def params(self, values: dict[str, Any]) -> list[Any]:
        out = []
        for key, value in values.items():
            convert = self.process[key]
            out.append(convert(value) if convert is not None and value is not None else value)
        return out

    def insert(self, keys: tuple[str, ...]) -> str:
        shape = ("insert", keys)
        sql = self.cache.get(shape)
        if sql is None:
            sql = self.cache[shape] = (
                f"INSERT INTO {JOBS.name} ({', '.join(keys)}) "
                f"VALUES ({', '.join('?' for _ in keys)})"
            )
        return sql

    def expression(self, expr: ClauseElement) -> tuple[str, list[Any]]:
        """A SQL expression given as a value (e.g. `func.coalesce(JOBS.c.started_at, now)`):
        its text in this dialect and its processed positional parameters."""
        compiled = cast(SQLCompiler, expr.compile(dialect=self.dialect))
        raw = compiled.construct_params() or {}
        params = []
        for name in compiled.positiontup or ():
            value = raw[name]
            impl = compiled.binds[name].type.dialect_impl(self.dialect)
            convert = impl.bind_processor(self.dialect)
            params.append(convert(value) if convert is not None and value is not None else value)
        return str(compiled), params

    def update(self, keys: tuple[str, ...], only_active: bool, unless_cancel: bool) -> str:
        shape = ("update", keys, only_active, unless_cancel)
        sql = self.cache.get(shape)
        if sql is None:
            sql = self.cache[shape] = (
                f"UPDATE {JOBS.name} SET {', '.join(f'{k} = ?' for k in keys)} "
                f"{self.where('?', only_active, unless_cancel)}"
            )
        return sql

    @staticmethod
    def where(id_mark: str, only_active: bool, unless_cancel: bool) -> str:
        """The WHERE clause of an update, the job id as the parameter `id_mark`."""
        where = [f"id = {id_mark}"]
        if only_active:
            where.append(f"state IN ({ACTIVE_SQL})")
        if unless_cancel:
            where.append("cancel_requested IS NULL")
        return f"WHERE {' AND '.join(where)}"


def _sqlite_connect(path: str, *, on_loop: bool) -> sqlite3.Connection:
    """A writer connection in autocommit mode, so transactions are the writer's own BEGIN
    IMMEDIATE ... COMMIT (it takes the write lock at once: with several processes on one file,
    a second writer waits in the busy handler instead of failing on upgrade). `on_loop`: the
    event loop's connection, which never waits for the lock and never checkpoints (see
    `_SqliteWriter`)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    _sqlite_pragmas(conn, None)  # type: ignore[arg-type]
    if on_loop:
        conn.execute("PRAGMA busy_timeout=0")
        conn.execute("PRAGMA wal_autocheckpoint=0")
    return conn


def _sqlite_transaction(db: sqlite3.Connection, writes: list[Write]) -> list[Any]:
    """`writes` in one transaction on `db`; _Busy if another connection holds the write lock."""
    try:
        db.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode == sqlite3.SQLITE_BUSY:
            raise _Busy from exc
        raise
    try:
        results = [write(db) for write in writes]
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return results


class _Busy(Exception):
    """Another connection (another worker process) holds SQLite's write lock."""


# A transaction carrying more job output than this is written on the writer thread: copying
# megabytes into the WAL would hold the event loop for milliseconds.
ON_LOOP_BYTES = 256 * 1024
# Roughly what SQLite's own wal_autocheckpoint (1000 pages) lets the WAL grow by.
CHECKPOINT_BYTES = 4 << 20
PAGE_BYTES = 4096  # what one small write adds to the WAL, about: a page of the table


class _SqliteWriter:
    """SQLite writes on the event loop when they are quick, else on one thread.

    On the thread alone (as before), a burst's transactions took 10-36 ms of wall time for
    0.2-2 ms of CPU: the thread waited for the GIL the busy loop held (5 ms per switch, several
    times per transaction), then for the loop to see its result, and every answer waited with
    it. A WAL commit with synchronous=NORMAL writes to the WAL file without an fsync: tens of
    microseconds per statement, less than the hand-off. Three things would block the loop, so
    they run on the thread, with its own connection:
    - another process's write lock (workers sharing the file): the loop's connection has no
      busy timeout, so its BEGIN IMMEDIATE fails at once and the thread redoes the transaction,
      waiting its turn for up to the 5 s busy timeout;
    - transactions carrying more than ON_LOOP_BYTES of job output;
    - checkpoints, which fsync: the loop's connection never checkpoints (wal_autocheckpoint=0);
      once about CHECKPOINT_BYTES were written on the loop, the Store's writer task runs one on
      the thread before its next transaction. Between two transactions, not beside them: a
      checkpoint racing this process's own writes never catches up with the WAL's end, and the
      WAL only starts over from its beginning after one that did (measured: 49 MiB of WAL for
      40 MiB written).
    The writer task runs one transaction or checkpoint at a time, so the two connections never
    write at once within this process."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="store-writer")
        self.loop_db: sqlite3.Connection | None = None
        self.thread_db: sqlite3.Connection | None = None
        self.unchecked = 0  # bytes written on the loop since the last checkpoint, about

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.thread_db = await loop.run_in_executor(
            self.thread, partial(_sqlite_connect, self.database, on_loop=False)
        )
        self.loop_db = _sqlite_connect(self.database, on_loop=True)

    async def transaction(self, writes: list[Write], size: int) -> list[Any]:
        assert self.loop_db is not None and self.thread_db is not None
        if size <= ON_LOOP_BYTES:
            try:
                results = _sqlite_transaction(self.loop_db, writes)
            except _Busy:
                pass
            else:
                self.unchecked += size + PAGE_BYTES * len(writes)
                return results
        # Busy or large; its commit may checkpoint on the thread (wal_autocheckpoint there).
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.thread, _sqlite_transaction, self.thread_db, writes)

    async def checkpoint_if_due(self) -> None:
        db = self.thread_db
        if self.unchecked < CHECKPOINT_BYTES or db is None:
            return
        self.unchecked = 0
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.thread, lambda: db.execute("PRAGMA wal_checkpoint(PASSIVE)").close()
            )
        except sqlite3.Error as exc:
            # The next one retries; meanwhile the WAL grows, which costs disk, not correctness.
            log.warning("store checkpoint failed: %s", exc)

    async def close(self) -> None:
        if self.loop_db is not None:
            self.loop_db.close()
            self.loop_db = None
        if self.thread_db is not None:
            db, self.thread_db = self.thread_db, None
            await asyncio.get_running_loop().run_in_executor(self.thread, db.close)
        self.thread.shutdown()


def _output_bytes(params: list[Any]) -> int:
    """The job output a statement carries: what decides where it is written (ON_LOOP_BYTES)."""
    return sum(len(p) for p in params if isinstance(p, bytes))


class _PgSql(_Sql):
    """The same statement shapes for PostgreSQL: `$n` placeholders, values converted by the
    asyncpg dialect's bind processors (JSON as text, which asyncpg passes to a json column)."""

    def __init__(self) -> None:
        super().__init__(make_url("postgresql+asyncpg://").get_dialect()())

    def insert(self, keys: tuple[str, ...]) -> str:
        shape = ("insert", keys)
        sql = self.cache.get(shape)
        if sql is None:
            marks = ", ".join(f"${n}" for n in range(1, len(keys) + 1))
            sql = self.cache[shape] = (
                f"INSERT INTO {JOBS.name} ({', '.join(keys)}) VALUES ({marks})"
            )
        return sql

    def update(self, keys: tuple[str, ...], only_active: bool, unless_cancel: bool) -> str:
        shape = ("update", keys, only_active, unless_cancel)
        sql = self.cache.get(shape)
        if sql is None:
            sets = ", ".join(f"{k} = ${n}" for n, k in enumerate(keys, 1))
            where = self.where(f"${len(keys) + 1}", only_active, unless_cancel)
            sql = self.cache[shape] = f"UPDATE {JOBS.name} SET {sets} {where}"
        return sql


class _PgWriter:
    """The writer's own asyncpg connection (PostgreSQL). Each statement shape is prepared once
    per connection (asyncpg's statement cache) and executed with plain values: through
    SQLAlchemy's `run_sync` every write built and compiled a Core statement, crossed greenlets,
    and every transaction checked a connection out of the pool with a ping (`pool_pre_ping`),
    a round trip of its own. Connection errors surface as SQLAlchemy's OperationalError, as
    they did through the engine, so an unreachable store is still a 503; the next transaction
    reconnects."""

    def __init__(self, url: str, schema: str | None) -> None:
        self.dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.settings = {"search_path": schema} if schema else {}
        self.sql = _PgSql()
        self.conn: asyncpg.Connection | None = None

    async def transaction(self, writes: list[Write]) -> list[Any]:
        try:
            if self.conn is None or self.conn.is_closed():
                self.conn = await asyncpg.connect(self.dsn, server_settings=self.settings)
            async with self.conn.transaction():
                return [await write(self.conn) for write in writes]
        except (asyncpg.InterfaceError, asyncpg.PostgresConnectionError, OSError) as exc:
            await self.close()
            raise OperationalError("store writer transaction", None, exc) from exc

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not conn.is_closed():
            conn.terminate()  # never waits on a server that went away


class Store:
    def __init__(self, url: str, *, schema: str | None = None) -> None:
        self.url = url
        self.schema = schema
        self._engine: AsyncEngine | None = None
        self._writes: asyncio.Queue[_Queued] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        # SQLite only: the writer's DB-API connections (the loop's and its thread's).
        self._sqlite: _SqliteWriter | None = None
        self._sql = _Sql()
        # PostgreSQL only: the writer's own asyncpg connection.
        self._pg: _PgWriter | None = None

    @property
    def dialect(self) -> str:
        return self.url.split(":", 1)[0].split("+", 1)[0]

    async def start(self) -> None:
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if self.dialect == "sqlite":
            path = self.url.split("///", 1)[-1]
            if path and path != ":memory:":
                # Before any connection exists: one blocking mkdir at start is fine.
                Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
        elif self.schema:
            kwargs["connect_args"] = {"server_settings": {"search_path": self.schema}}
        engine = create_async_engine(self.url, **kwargs)
        if self.dialect == "sqlite":
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        for attempt in range(SCHEMA_ATTEMPTS):
            try:
                async with engine.begin() as conn:
                    if self.schema and self.dialect == "postgresql":
                        quoted = engine.dialect.identifier_preparer.quote_identifier(self.schema)
                        await conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {quoted}"))
                    await conn.run_sync(METADATA.create_all)
                    await conn.run_sync(_add_missing_columns)
                break
            except DBAPIError:
                # Workers (or replicas) starting together on a new database race between
                # create_all's check and its CREATE ("table sshapi_jobs already exists": the
                # loser crashed and was restarted). Checked again, the table is there.
                if attempt == SCHEMA_ATTEMPTS - 1:
                    await engine.dispose()
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
        self._engine = engine
        if self.dialect == "postgresql":
            self._pg = _PgWriter(self.url, self.schema)
        if self.dialect == "sqlite":
            self._sqlite = _SqliteWriter(make_url(self.url).database or ":memory:")
            await self._sqlite.start()
        self._writer = asyncio.create_task(self._write_loop(), name="store-writer")

    async def close(self) -> None:
        if self._writer is not None:
            await self._writes.join()  # every accepted write is committed (or failed) first
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        if self._sqlite is not None:
            await self._sqlite.close()
            self._sqlite = None
        if self._pg is not None:
            await self._pg.close()
            self._pg = None
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    def _started(self) -> AsyncEngine:
        """The engine, for reads and the rare statements outside the writer (mark_lost)."""
        if self._engine is None:
            raise RuntimeError("store not started")
        return self._engine

    async def _rows(self, query: Select[Any]) -> list[JobRow]:
        async with self._started().connect() as conn:
            return [_job(r) for r in await conn.execute(query)]

    async def _one(self, query: Select[Any]) -> JobRow | None:
        rows = await self._rows(query)
        return rows[0] if rows else None

    async def ping(self) -> None:
        async with self._started().connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def _write(self, write: Write, size: int = 0) -> Any:
        """Queue a write for the writer; returns its result once its transaction committed.
        `size`: the job output it carries, in bytes."""
        if self._writer is None:
            raise RuntimeError("store not started")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._writes.put_nowait((write, size, done))
        return await done

    async def _write_loop(self) -> None:
        while True:
            batch = [await self._writes.get()]
            while len(batch) < MAX_BATCH and not self._writes.empty():
                batch.append(self._writes.get_nowait())
            try:
                await self._commit(batch)
            except Exception:
                # One bad write (a duplicate idempotency key) must not fail the others: apply
                # each in its own transaction so that only it gets the error.
                for item in batch:
                    with contextlib.suppress(Exception):
                        await self._commit([item])
            finally:
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
            size = _output_bytes(params)

            def add(db: sqlite3.Connection) -> None:
                try:
                    db.execute(sql, params)
                except sqlite3.IntegrityError as exc:
                    # The same exception as from SQLAlchemy: callers catch one kind.
                    raise IntegrityError(sql, params, exc) from None
        elif self._pg is not None:
            pg = self._pg.sql
            values = pg.with_defaults(values)
            sql, params = pg.insert(tuple(values)), pg.params(values)

            async def add(conn: asyncpg.Connection) -> None:
                try:
                    await conn.execute(sql, *params)
                except asyncpg.UniqueViolationError as exc:
                    raise IntegrityError(sql, params, exc) from None
        else:

            def add(conn: Connection) -> None:
                conn.execute(insert(JOBS).values(values))

        await self._write(add, size)
        return row

    async def get(self, job_id: str) -> JobRow | None:
        return await self._one(select(JOBS).where(JOBS.c.id == job_id))

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
        no other replica asked to cancel it. True if a row changed."""
        if self._sqlite is not None:
            exprs = {k: v for k, v in values.items() if isinstance(v, ClauseElement)}
            if exprs:  # rare: built per call, not cached
                sql, params = self._update_with_expressions(
                    job_id, values, exprs, only_active, unless_cancel_requested
                )
            else:
                sql = self._sql.update(tuple(values), only_active, unless_cancel_requested)
                params = [*self._sql.params(values), job_id]

            def run(db: sqlite3.Connection) -> bool:
                return db.execute(sql, params).rowcount > 0

            return bool(await self._write(run, _output_bytes(params)))
        if self._pg is not None:
            pg = self._pg.sql
            if any(isinstance(v, ClauseElement) for v in values.values()):  # rare: per call
                sets, params = pg.expression(update(JOBS).values(**values))
                params.append(job_id)
                sql = f"{sets} {pg.where(f'${len(params)}', only_active, unless_cancel_requested)}"
            else:
                sql = pg.update(tuple(values), only_active, unless_cancel_requested)
                params = [*pg.params(values), job_id]

            async def change(conn: asyncpg.Connection) -> bool:
                status: str = await conn.execute(sql, *params)  # "UPDATE <rows>"
                return status.rsplit(" ", 1)[-1] != "0"

            return bool(await self._write(change))
        query = update(JOBS).where(JOBS.c.id == job_id).values(**values)
        if only_active:
            query = query.where(JOBS.c.state.in_(ACTIVE))
        if unless_cancel_requested:
            query = query.where(JOBS.c.cancel_requested.is_(None))

        def execute(conn: Connection) -> bool:
            return bool(conn.execute(query).rowcount)

        return bool(await self._write(execute))

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
        async with self._started().begin() as conn:
            result = await conn.execute(query)
            return int(result.rowcount)

    async def active_batch(self, replica: str) -> list[JobRow]:
        """Batch jobs of this replica not final yet: tracked again (or resolved) on start."""
        c = JOBS.c
        return await self._rows(
            select(JOBS).where(c.replica == replica, c.kind == "batch", c.state.in_(ACTIVE))
        )


def _add_missing_columns(conn: Connection) -> None:
    """ADD COLUMN for every column of JOBS an existing table lacks (all added ones are nullable)."""
    present = {c["name"] for c in inspect(conn).get_columns(JOBS.name)}
    for column in JOBS.columns:
        if column.name not in present:
            kind = column.type.compile(dialect=conn.dialect)
            quoted = conn.dialect.identifier_preparer.quote(column.name)
            conn.execute(text(f"ALTER TABLE {JOBS.name} ADD COLUMN {quoted} {kind}"))


def aware(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; every time here is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value
