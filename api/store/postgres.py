"""PostgreSQL's writer: no thread needed. It keeps its own asyncpg connection on the event loop
and runs the same statement shapes as SQLite's writer as text with `$n` parameters, each
prepared once per connection by asyncpg's statement cache; reads still go through SQLAlchemy."""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from api.store.portals import EVENTS_LOCK, Logged
from api.store.schema import JOBS, Write
from api.store.sqlite import Sql


def output_bytes(params: list[Any]) -> int:
    """The job output a statement carries: what decides where it is written (ON_LOOP_BYTES)."""
    return sum(len(p) for p in params if isinstance(p, bytes))


class PgSql(Sql):
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


class PgWriter:
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
        self.sql = PgSql()
        self.conn: asyncpg.Connection | None = None

    async def transaction(self, writes: list[Write]) -> list[Any]:
        try:
            if self.conn is None or self.conn.is_closed():
                self.conn = await asyncpg.connect(self.dsn, server_settings=self.settings)
            async with self.conn.transaction():
                if any(isinstance(write, Logged) for write in writes):
                    # First, before any row lock: events commit in seq order (portals.py).
                    await self.conn.execute("SELECT pg_advisory_xact_lock($1)", EVENTS_LOCK)
                return [await write(self.conn) for write in writes]
        except (asyncpg.InterfaceError, asyncpg.PostgresConnectionError, OSError) as exc:
            await self.close()
            raise OperationalError("store writer transaction", None, exc) from exc

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not conn.is_closed():
            conn.terminate()  # never waits on a server that went away
