"""The job store's schema, moved forward by Alembic: at start where the operator allows it
(`SSHAPI_DB_UPGRADE=auto`, the default) or by `sshapi db upgrade`; with `off`, a store whose
database is not at this release's revision refuses to start and names the command.

Every migration runs in one transaction on one connection that holds the database's migration
lock, so workers and replicas starting together on a new or older database upgrade it once and
the others find it done: on PostgreSQL a transaction-scoped advisory lock (DDL is
transactional there), on SQLite the write lock taken by `BEGIN IMMEDIATE` (pysqlite's own
transaction handling would start the transaction only at the first write and commit before DDL,
so the engine here leaves transactions to us, as SQLAlchemy's documentation advises).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, event, text
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from api.store.sqlite import sqlite_pragmas

# pg_advisory_xact_lock's key: any constant of our own (the crc32 of "sshapi-store-migrate").
PG_LOCK = 0x2B5E_0C41


class SchemaError(Exception):
    """The database is not at the revision this release needs and may not be upgraded here."""


@dataclass(frozen=True, slots=True)
class Upgrade:
    """What an upgrade found and left: revisions (None: no schema yet)."""

    before: str | None
    after: str | None


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", "api.store:migrations")
    config.attributes["connection"] = connection
    return config


def head() -> str | None:
    """The revision this release's code expects."""
    return ScriptDirectory.from_config(_config()).get_current_head()


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def _upgrade(connection: Connection) -> Upgrade:
    before = _current(connection)
    command.upgrade(_config(connection), "head")
    return Upgrade(before, _current(connection))


def _engine_options(url: str, schema: str | None) -> dict[str, Any]:
    if url.startswith("postgresql") and schema:
        return {"connect_args": {"server_settings": {"search_path": schema}}}
    return {}


def _sqlite_manual_transactions(dbapi_conn: DBAPIConnection, record: ConnectionPoolEntry) -> None:
    sqlite_pragmas(dbapi_conn, record)
    dbapi_conn.isolation_level = None


async def _locked(conn: AsyncConnection, schema: str | None) -> None:
    """Take the migration lock (PostgreSQL; SQLite took it with BEGIN IMMEDIATE) and make sure
    the schema the store lives in exists."""
    if conn.dialect.name != "postgresql":
        return
    await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_LOCK})
    if schema:
        quoted = conn.dialect.identifier_preparer.quote_identifier(schema)
        await conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {quoted}"))


async def upgrade(url: str, schema: str | None = None) -> Upgrade:
    """Bring the database at `url` (and PostgreSQL `schema`) to this release's revision."""
    engine = create_async_engine(url, **_engine_options(url, schema))
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_manual_transactions)
        event.listen(
            engine.sync_engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE")
        )
    try:
        async with engine.begin() as conn:
            await _locked(conn, schema)
            return await conn.run_sync(_upgrade)
    finally:
        await engine.dispose()


async def check(url: str, schema: str | None = None) -> None:
    """SchemaError unless the database is at this release's revision."""
    engine = create_async_engine(url, **_engine_options(url, schema))
    try:
        async with engine.connect() as conn:
            current = await conn.run_sync(_current)
    finally:
        await engine.dispose()
    wanted = head()
    if current != wanted:
        found = f"at revision {current}" if current else "without the store's schema"
        raise SchemaError(
            f"the job database is {found}; this release needs revision {wanted}: run "
            "`sshapi db upgrade` (or set SSHAPI_DB_UPGRADE=auto to upgrade at start)"
        )
