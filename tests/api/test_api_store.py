"""The job store on SQLite and PostgreSQL: ordering, idempotency keys, lost-at-start."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func
from sqlalchemy.exc import IntegrityError

from api.store import JOBS, JobRow, Store, aware, new_id, utcnow
from api.store.sqlite import sqlite_pragmas
from api.tasks import Supervisor


def job(**over: Any) -> JobRow:
    values: dict[str, Any] = {
        "id": new_id(),
        "owner_iss": "iss",
        "owner_sub": "alice",
        "replica": "r1",
        "host": "local",
        "target": "u@h:22",
        "argv": ["true"],
        "timeout": 10.0,
        "state": "queued",
        "created_at": utcnow(),
        "timings": {},
    }
    values.update(over)
    return JobRow(**values)


async def test_ids_sort_by_creation_time() -> None:
    """UUIDv7 ids made later sort after earlier ones (the list order and the cursor rely on it)."""
    ids = []
    for _ in range(5):
        ids.append(new_id())
        await asyncio.sleep(0.002)
    assert ids == sorted(ids)
    assert all(i[14] == "7" for i in ids)  # version nibble


async def test_round_trip_keeps_bytes_and_json(store: Store) -> None:
    """Output bytes (even invalid UTF-8) and JSON columns come back as stored."""
    row = await store.insert(job(stdout=b"\xff\x00ok", stderr=b"", timings={"exec": 1.5}))
    back = await store.get(row.id)
    assert back is not None
    assert (back.stdout, back.timings, back.argv) == (b"\xff\x00ok", {"exec": 1.5}, ["true"])


async def test_idempotency_key_is_unique_per_owner(store: Store) -> None:
    """The same key twice for one owner violates the constraint; for another owner it does not."""
    await store.insert(job(idempotency_key="k"))
    await store.insert(job(idempotency_key="k", owner_sub="bob"))
    with pytest.raises(IntegrityError):
        await store.insert(job(idempotency_key="k"))
    found = await store.by_key("iss", "bob", "k")
    assert found is not None and found.owner_sub == "bob"


async def test_mark_lost_touches_only_this_replicas_active_jobs(store: Store) -> None:
    """Start-up marks this replica's queued/running jobs lost, not finished ones, not others'."""
    mine_running = await store.insert(job(state="running"))
    mine_queued = await store.insert(job(state="queued"))
    mine_done = await store.insert(job(state="succeeded"))
    theirs = await store.insert(job(state="running", replica="r2"))
    assert await store.mark_lost("r1") == 2
    states = {
        r.id: r.state
        for r in await store.list_jobs(owner=None, state=None, host=None, limit=10, before=None)
    }
    assert states[mine_running.id] == states[mine_queued.id] == "lost"
    assert (states[mine_done.id], states[theirs.id]) == ("succeeded", "running")


async def test_mark_lost_records_cancelled_for_jobs_another_replica_cancelled(
    store: Store,
) -> None:
    """A job another replica killed (cancel requested) while its owner was down comes back
    `cancelled` with the reason, not `lost`."""
    killed = await store.insert(job(state="running", pgid=4242))
    assert await store.update(killed.id, only_active=True, cancel_requested="cancelled by bob")
    assert not await store.update(
        killed.id, only_active=True, unless_cancel_requested=True, state="running"
    )
    assert await store.mark_lost("r1") == 1
    back = await store.get(killed.id)
    assert back is not None
    assert (back.state, back.error, back.pgid) == ("cancelled", "cancelled by bob", 4242)


async def test_update_only_active_never_overwrites_a_final_state(store: Store) -> None:
    """A late `running` write after `cancelled` changes nothing."""
    row = await store.insert(job(state="cancelled"))
    assert await store.update(row.id, only_active=True, state="running") is False
    back = await store.get(row.id)
    assert back is not None and back.state == "cancelled"


async def test_update_with_a_sql_expression_keeps_the_first_start_time(store: Store) -> None:
    """`started_at = coalesce(started_at, now)` (what the batch tracker writes) sets the start
    once: a second such write keeps the first time, and the row reads back with it."""
    row = await store.insert(job())
    first = utcnow()
    assert await store.update(
        row.id, only_active=True, state="running",
        started_at=func.coalesce(JOBS.c.started_at, first),
    )  # fmt: skip
    await asyncio.sleep(0.01)
    assert await store.update(row.id, started_at=func.coalesce(JOBS.c.started_at, utcnow()))
    back = await store.get(row.id)
    assert back is not None and back.state == "running"
    assert aware(back.started_at) == first


async def _loop_lag(during: asyncio.Future[Any], tick: float = 0.01) -> float:
    """The worst lateness (seconds) of a `tick` sleep on this event loop until `during` is done."""
    loop, worst = asyncio.get_running_loop(), 0.0
    while not during.done():
        start = loop.time()
        await asyncio.sleep(tick)
        worst = max(worst, loop.time() - start - tick)
    return worst


async def test_sqlite_writes_wait_for_another_process_lock_without_blocking_the_loop(
    tmp_path: Path, tasks: Supervisor
) -> None:
    """Another worker holding SQLite's write lock (workers share one file) delays this
    process's writes until it commits, but never freezes the event loop meanwhile: every other
    request goes on being served."""
    path = tmp_path / "jobs.sqlite3"
    store = Store(f"sqlite+aiosqlite:///{path}")
    await store.start(tasks)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        await store.insert(job())  # the file and its WAL exist
        other.execute("BEGIN IMMEDIATE")  # the other worker's transaction, held open
        insert = asyncio.ensure_future(store.insert(job(stdout=b"x" * 100)))
        release = asyncio.get_running_loop().call_later(0.6, other.execute, "COMMIT")
        lag = await _loop_lag(insert)
        release.cancel()
        row = await insert
        assert lag < 0.2, f"the event loop stalled {lag:.3f} s behind the lock"
        back = await store.get(row.id)
        assert back is not None and back.stdout == b"x" * 100
    finally:
        other.close()
        await store.close()


def test_connections_switching_a_new_sqlite_file_to_wal_together_all_open(
    tmp_path: Path,
) -> None:
    """Workers starting together on a new SQLite file all open it: SQLite answers the second
    of two simultaneous switches to WAL "database is locked" at once, without waiting for the
    busy timeout (before the retry, 9 of 400 such connections failed)."""
    failures: list[BaseException] = []

    def open_and_write(path: Path, start: threading.Barrier) -> None:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            start.wait()
            sqlite_pragmas(db, None)  # type: ignore[arg-type]
            db.execute("BEGIN IMMEDIATE")
            db.execute("CREATE TABLE IF NOT EXISTS t (x)")
            db.execute("COMMIT")
        except BaseException as exc:
            failures.append(exc)
        finally:
            db.close()

    for round_ in range(50):
        path, start = tmp_path / f"new-{round_}.sqlite3", threading.Barrier(4)
        threads = [threading.Thread(target=open_and_write, args=(path, start)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert failures == []


async def test_sqlite_wal_stays_bounded_and_large_outputs_round_trip(
    tmp_path: Path, tasks: Supervisor
) -> None:
    """Writing far more than a WAL's worth of job output, in outputs small and large, keeps the
    WAL file near its checkpoint size (a disk that fills up with WAL is an outage) and every
    output reads back whole."""
    path = tmp_path / "jobs.sqlite3"
    store = Store(f"sqlite+aiosqlite:///{path}")
    await store.start(tasks)
    try:
        small, large = b"s" * (100 << 10), b"L" * (2 << 20)
        rows = [await store.insert(job(stdout=small, stderr=b"")) for _ in range(400)]  # 40 MiB
        wal = (tmp_path / "jobs.sqlite3-wal").stat().st_size
        assert wal < 24 << 20, f"WAL grew to {wal >> 20} MiB for 40 MiB written"
        rows += [await store.insert(job(stdout=large, stderr=small)) for _ in range(3)]
        for row in (rows[0], rows[399], rows[-1]):
            back = await store.get(row.id)
            assert back is not None and (back.stdout, back.stderr) == (row.stdout, row.stderr)
    finally:
        await store.close()


async def test_prune_deletes_jobs_that_ended_before_the_cutoff_and_never_active_ones(
    store: Store,
) -> None:
    """`sshapi db prune --older-than 30`: an ended job of 40 days ago goes; one of 10 days ago
    stays, and so does a job still running after 40 days (its end is not known yet)."""
    from datetime import timedelta

    from api.store import prune

    now = utcnow()
    old = await store.insert(job(state="succeeded", finished_at=now - timedelta(days=40)))
    recent = await store.insert(job(state="failed", finished_at=now - timedelta(days=10)))
    running = await store.insert(job(state="running", created_at=now - timedelta(days=40)))
    assert await prune(store.url, store.schema, now - timedelta(days=30)) == 1
    assert await store.get(old.id) is None
    assert await store.get(recent.id) is not None and await store.get(running.id) is not None


def test_db_prune_command_reports_what_it_deleted(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "SSHAPI_DATA_DIR": str(tmp_path / "data")}
    env.pop("SSHAPI_DATABASE_URL", None)
    sshapi = str(Path(sys.executable).parent / "sshapi")
    subprocess.run([sshapi, "db", "upgrade"], env=env, check=True, capture_output=True)
    done = subprocess.run(
        [sshapi, "db", "prune", "--older-than", "30"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deleted 0 job(s) that ended before ")
    refused = subprocess.run(
        [sshapi, "db", "prune", "--older-than", "-1"], env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2


async def test_a_writer_that_dies_is_restarted_and_no_accepted_write_is_lost(
    tmp_path: Path, tasks: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's writer is a task of the supervisor's (api/services.py): when its loop dies
    (here: its checkpoint step raises once, a bug), it is logged and started again, and the writes
    queued meanwhile commit; the process stays healthy."""
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'jobs.sqlite3'}")
    await store.start(tasks)
    try:
        assert store._sqlite is not None
        real = store._sqlite.checkpoint_if_due
        failures = iter([RuntimeError("a bug in the writer loop")])

        async def flaky() -> None:
            failure = next(failures, None)
            if failure is not None:
                raise failure
            await real()

        monkeypatch.setattr(store._sqlite, "checkpoint_if_due", flaky)
        first = await store.insert(job())  # committed; then the loop dies after it
        rest = await asyncio.wait_for(
            asyncio.gather(*(store.insert(job()) for _ in range(5))), timeout=10
        )
        for row in [first, *rest]:
            assert await store.get(row.id) is not None
        assert tasks.healthy
    finally:
        await store.close()
