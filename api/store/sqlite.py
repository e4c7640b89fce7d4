"""SQLite's writer: each whole transaction on a plain sqlite3 connection with SQL text built once
per statement shape (`Sql`), on the event loop itself unless it would block it (`SqliteWriter`).

Through aiosqlite every statement, cursor, ping and commit was a thread hop with a GIL handoff
(about 12 per job), even one hop per transaction cost a burst tens of milliseconds per commit,
and building a Core statement per write (cache key, coercions) cost about as much as running it
(docs/benchmarks.md has the figures). Values go through the columns' own SQLAlchemy bind
processors, so what the writer stores reads back through Core exactly as what SQLAlchemy itself
writes."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, cast

from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine.interfaces import DBAPIConnection, Dialect
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from api.store.schema import ACTIVE_SQL, JOBS, Write, utcnow

log = logging.getLogger("sshapi.store")


# How long a connection waits for another's lock, here and in the switch to WAL.
BUSY_TIMEOUT_S = 5.0


def sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_conn.cursor()
    # First: switching to WAL takes a lock, and another worker migrating the database at start
    # holds it (without a busy timeout the switch failed at once: "database is locked").
    cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    # WAL: readers never block the writer; NORMAL sync is durable across process crashes (the
    # WAL is fsynced at checkpoints; a power loss can drop the last commits).
    _switch_to_wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _switch_to_wal(cursor: Any) -> None:
    """PRAGMA journal_mode=WAL, again while another connection converts the same new file:
    SQLite answers that race SQLITE_BUSY at once, without its busy handler (4 workers starting
    on a new database: 9 of 400 connections failed so). Only at a database's first start: once
    the file is WAL, the switch is a no-op that takes no lock."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.01)  # a connection's first statements, on its own thread or at start


class Sql:
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

    def now(self) -> list[Any]:
        """The time now as a parameter of this dialect (a job event's `at`)."""
        return self.params({"created_at": utcnow()})

    def _built(self, shape: tuple[Any, ...], build: Callable[[], str]) -> str:
        """The statement of `shape`: built on its first use, then taken from the cache."""
        sql = self.cache.get(shape)
        if sql is None:
            sql = self.cache[shape] = build()
        return sql

    def insert(self, keys: tuple[str, ...]) -> str:
        return self._built(
            ("insert", keys),
            lambda: (
                f"INSERT INTO {JOBS.name} ({', '.join(keys)}) "
                f"VALUES ({', '.join('?' for _ in keys)})"
            ),
        )

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
        return self._built(
            ("update", keys, only_active, unless_cancel),
            lambda: (
                f"UPDATE {JOBS.name} SET {', '.join(f'{k} = ?' for k in keys)} "
                f"{self.where('?', only_active, unless_cancel)}"
            ),
        )

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
    `SqliteWriter`)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    sqlite_pragmas(conn, None)  # type: ignore[arg-type]
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


class SqliteWriter:
    """SQLite writes on the event loop when they are quick, else on one thread.

    On the thread alone (as before), a burst's transactions took many times their CPU in wall
    time: the thread waited for the GIL the busy loop held (a switch interval each, several
    times per transaction), then for the loop to see its result, and every answer waited with
    it (docs/benchmarks.md, "Figures behind the code"). A WAL commit with synchronous=NORMAL
    writes to the WAL file without an fsync: tens of microseconds per statement, less than the
    hand-off. Three things would block the loop, so they run on the thread, with its own
    connection:
    - another process's write lock (workers sharing the file): the loop's connection has no
      busy timeout, so its BEGIN IMMEDIATE fails at once and the thread redoes the transaction,
      waiting its turn for up to the 5 s busy timeout;
    - transactions carrying more than ON_LOOP_BYTES of job output;
    - checkpoints, which fsync: the loop's connection never checkpoints (wal_autocheckpoint=0);
      once about CHECKPOINT_BYTES were written on the loop, the Store's writer task runs one on
      the thread before its next transaction. Between two transactions, not beside them: a
      checkpoint racing this process's own writes never catches up with the WAL's end, and the
      WAL only starts over from its beginning after one that did (else it grows past what was
      written).
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
