"""The job store's migrations: a database the previous release wrote upgrades with its jobs, on
SQLite and PostgreSQL; starts racing on a new database migrate once; `SSHAPI_DB_UPGRADE=off`
refuses an old database and `sshapi db upgrade` fixes it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from api_helpers import PG_URL, pg_schema
from sqlalchemy import Connection, insert, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from api.store import JOBS, JobRow, Store, aware, migrate, new_id, utcnow
from api.store.schema import METADATA
from api.tasks import Supervisor

# The jobs table exactly as release 0.1.0 (63c127d) created it (`create_all`), per dialect.
PREVIOUS_RELEASE = """
CREATE TABLE sshapi_jobs (
    id VARCHAR(36) NOT NULL, owner_iss VARCHAR(512) NOT NULL, owner_sub VARCHAR(512) NOT NULL,
    replica VARCHAR(255) NOT NULL, host VARCHAR(64) NOT NULL, target VARCHAR(512) NOT NULL,
    argv JSON, command TEXT, template VARCHAR(64), params JSON, timeout FLOAT NOT NULL,
    state VARCHAR(16) NOT NULL, error TEXT, error_kind VARCHAR(64), exit_status INTEGER,
    exit_signal VARCHAR(32), stdout {blob} NOT NULL, stderr {blob} NOT NULL,
    stdout_bytes INTEGER NOT NULL, stderr_bytes INTEGER NOT NULL,
    stdout_truncated BOOLEAN NOT NULL, stderr_truncated BOOLEAN NOT NULL,
    created_at {time} NOT NULL, started_at {time}, finished_at {time}, timings JSON NOT NULL,
    idempotency_key VARCHAR(255), request_hash VARCHAR(64), kind VARCHAR(16), batch JSON,
    scheduler_job_id VARCHAR(32), scheduler_state VARCHAR(64), scheduler_reason TEXT,
    pgid INTEGER, cancel_requested TEXT,
    PRIMARY KEY (id),
    CONSTRAINT sshapi_jobs_idem UNIQUE (owner_iss, owner_sub, idempotency_key)
)"""
PREVIOUS_INDEXES = [
    "CREATE INDEX sshapi_jobs_owner ON sshapi_jobs (owner_iss, owner_sub, id)",
    "CREATE INDEX sshapi_jobs_replica_state ON sshapi_jobs (replica, state)",
]
# Columns added by releases before 0.1.0 (nullable, added at start): an older table lacks them.
LATER_COLUMNS = (
    "kind VARCHAR(16), batch JSON, scheduler_job_id VARCHAR(32), scheduler_state VARCHAR(64), "
    "scheduler_reason TEXT, pgid INTEGER, cancel_requested TEXT, "
)
TYPES = {
    "sqlite": {"blob": "BLOB", "time": "DATETIME"},
    "postgresql": {"blob": "BYTEA", "time": "TIMESTAMP WITH TIME ZONE"},
}


@pytest.fixture(params=["sqlite", "postgresql"])
async def database(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, str | None]]:
    """A new, empty database: its URL and (PostgreSQL) schema."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'jobs.sqlite3'}", None
        return
    async with pg_schema() as schema:
        yield PG_URL, schema


def _engine(url: str, schema: str | None) -> AsyncEngine:
    if schema:
        return create_async_engine(url, connect_args={"server_settings": {"search_path": schema}})
    return create_async_engine(url)


def _job(**over: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "id": new_id(),
        "owner_iss": "https://idp.example.org",
        "owner_sub": "alice",
        "replica": "r1",
        "host": "cluster",
        "target": "alice@login1:22",
        "argv": ["echo", "hi"],
        "timeout": 30.0,
        "state": "succeeded",
        "exit_status": 0,
        "stdout": b"hi\n\xff",
        "stderr": b"",
        "stdout_bytes": 4,
        "stderr_bytes": 0,
        "stdout_truncated": False,
        "stderr_truncated": False,
        "created_at": utcnow(),
        "finished_at": utcnow(),
        "timings": {"exec": 2.5},
        "idempotency_key": "k1",
    }
    values.update(over)
    return values


async def _previous_release_database(
    url: str, schema: str | None, *, older: bool = False
) -> list[dict[str, Any]]:
    """Write the table as the previous release did (or, `older`, as one before the batch
    columns) and three jobs into it, as that release's Core inserts did."""
    dialect = "postgresql" if url.startswith("postgresql") else "sqlite"
    ddl = PREVIOUS_RELEASE.format(**TYPES[dialect])
    jobs = [
        _job(),
        _job(state="failed", exit_status=3, stdout=b"", stdout_bytes=0, idempotency_key=None),
        _job(owner_sub="bob", state="lost", error="the API restarted", idempotency_key=None),
        _job(state="running", exit_status=None, finished_at=None, idempotency_key=None),
    ]
    if older:
        ddl = ddl.replace(LATER_COLUMNS, "")
    else:
        jobs.append(
            _job(
                kind="batch",
                batch={"script": "#!/bin/sh\nsrun true\n", "options": {"partition": "debug"}},
                scheduler_job_id="4711",
                scheduler_state="COMPLETED",
                idempotency_key=None,
            )
        )
    engine = _engine(url, schema)
    try:
        async with engine.begin() as conn:
            if schema:
                await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            await conn.execute(text(ddl))
            for index in PREVIOUS_INDEXES:
                await conn.execute(text(index))
            columns = {c.key for c in JOBS.columns}
            for job in jobs:
                row = {k: v for k, v in job.items() if k in columns}
                await conn.execute(insert(JOBS).values(row))
    finally:
        await engine.dispose()
    return jobs


async def _revision_and_drift(url: str, schema: str | None) -> tuple[str | None, list[Any]]:
    def read(conn: Connection) -> tuple[str | None, list[Any]]:
        context = MigrationContext.configure(conn)
        return context.get_current_revision(), compare_metadata(context, METADATA)

    engine = _engine(url, schema)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(read)
    finally:
        await engine.dispose()


def _same(row: JobRow | None, job: dict[str, Any]) -> None:
    assert row is not None
    for key, value in job.items():
        got = getattr(row, key)
        assert (aware(got) if isinstance(got, datetime) else got) == value, key


@pytest.mark.parametrize("older", [False, True], ids=["release-0.1.0", "before-batch-jobs"])
async def test_a_database_of_the_previous_release_upgrades_with_every_job(
    database: tuple[str, str | None], older: bool, tasks: Supervisor
) -> None:
    """A table (with jobs) the previous release, or one before it, created reaches this
    release's revision at start, every job reads back as written, and a new job goes in."""
    url, schema = database
    jobs = await _previous_release_database(url, schema, older=older)
    store = Store(url, schema=schema)
    await store.start(tasks)
    try:
        for job in jobs:
            _same(await store.get(job["id"]), job)
        if older:
            assert (await store.get(jobs[0]["id"])).kind is None  # type: ignore[union-attr]
        again = await store.by_key("https://idp.example.org", "alice", "k1")
        assert again is not None and again.id == jobs[0]["id"]
        fresh = JobRow(
            **_job(idempotency_key="k2", state="running", finished_at=None),
            kind="batch",
            batch={"script": "#!/bin/sh\n"},
            scheduler_job_id="7",
        )
        await store.insert(fresh)
        assert [r.id for r in await store.active_batch("r1")] == [fresh.id]
        assert await store.mark_lost("r1") == 1  # the running command; the batch job stays
        listed = await store.list_jobs(
            owner=("https://idp.example.org", "alice"), state=None, host=None, limit=10, before=None
        )
        assert len(listed) == (4 if older else 5)
    finally:
        await store.close()
    revision, drift = await _revision_and_drift(url, schema)
    assert revision == migrate.head()
    assert drift == [], f"the migrated schema differs from api/store/schema.py: {drift}"


async def test_a_new_database_gets_exactly_the_schema_the_code_uses(
    database: tuple[str, str | None],
) -> None:
    """The revisions build the table the code reads and writes (no drift: a change to
    api/store/schema.py without a revision fails here)."""
    url, schema = database
    done = await migrate.upgrade(url, schema)
    assert (done.before, done.after) == (None, migrate.head())
    assert await _revision_and_drift(url, schema) == (migrate.head(), [])
    again = await migrate.upgrade(url, schema)
    assert again.before == again.after == migrate.head()


async def test_stores_starting_together_on_a_new_database_migrate_it_once(
    database: tuple[str, str | None], tasks: Supervisor
) -> None:
    """Four workers starting at once on a new database all start (the migration lock makes
    the others wait and find it done) and share one table."""
    url, schema = database
    stores = [Store(url, schema=schema) for _ in range(4)]
    await asyncio.gather(*(s.start(tasks) for s in stores))
    try:
        rows = [JobRow(**_job(idempotency_key=None)) for _ in stores]
        await asyncio.gather(*(s.insert(r) for s, r in zip(stores, rows, strict=True)))
        for row in rows:
            assert (await stores[0].get(row.id)) is not None
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    assert (await _revision_and_drift(url, schema))[0] == migrate.head()


def _sshapi(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "sshapi"), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_with_upgrades_off_an_old_database_is_refused_until_sshapi_db_upgrade(
    database: tuple[str, str | None], tmp_path: Path, config_file: Path, tasks: Supervisor
) -> None:
    """SSHAPI_DB_UPGRADE=off: the store and `sshapi serve` refuse a database of the previous
    release and name the command; `sshapi db upgrade` brings it forward, and then the store
    starts with the jobs intact."""
    url, schema = database
    jobs = await _previous_release_database(url, schema)
    store = Store(url, schema=schema, upgrade=False)
    with pytest.raises(migrate.SchemaError, match="sshapi db upgrade"):
        await store.start(tasks)
    env = {"SSHAPI_DATA_DIR": str(tmp_path / "data"), "SSHAPI_DATABASE_URL": url}
    if schema:
        env["SSHAPI_DATABASE_SCHEMA"] = schema
    served = _sshapi(
        ["serve"], {**env, "SSHAPI_DB_UPGRADE": "off", "SSHAPI_CONFIG": str(config_file)}
    )
    assert served.returncode == 2 and "run `sshapi db upgrade`" in served.stderr, served.stderr
    first = _sshapi(["db", "upgrade"], env)
    assert first.returncode == 0, first.stderr
    assert f"upgraded from an unversioned database to {migrate.head()}" in first.stdout
    again = await migrate.upgrade(url, schema)
    assert again.before == again.after == migrate.head()
    await store.start(tasks)
    try:
        for job in jobs:
            _same(await store.get(job["id"]), job)
    finally:
        await store.close()
