"""What the store keeps for portals (issue 43): the job event log behind the change feed
(`GET /v1/jobs/events`) and job handles. The events are written with the state changes
themselves (api/store/store.py: `Logged` writes, in the same transaction); here are their
statements, the feed's reads, and the handles' rare reads and writes (outside the job writer,
one statement each, as revocations are, through api/store/shielded.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, literal, select
from sqlalchemy.ext.asyncio import AsyncEngine

from api.store.schema import (
    JOB_EVENTS,
    JOB_HANDLES,
    JOBS,
    LISTED,
    JobHandle,
    JobRow,
    Write,
    aware,
    utcnow,
)
from api.store.shielded import Transactions

# pg_advisory_xact_lock's key for writing events: transactions that add events take it first
# (before any row lock, so it can never be part of a deadlock), so seqs commit in order.
EVENTS_LOCK = 0x2B5E_0C42
EVENTS = JOB_EVENTS.name
# The event of a job whose row was just changed, from the row itself: its owner and new state.
# `RETURNING` tells the writer whose feed to wake (SQLite has it since 3.35).
EVENT_FROM_ROW = (
    f"INSERT INTO {EVENTS} (owner_iss, owner_sub, job_id, state, at) "
    f"SELECT owner_iss, owner_sub, id, state, {{at}} FROM {JOBS.name} WHERE id = {{id}} "
    "RETURNING owner_iss, owner_sub"
)
EVENT_VALUES = f"INSERT INTO {EVENTS} (owner_iss, owner_sub, job_id, state, at) VALUES ({{marks}})"
SQLITE_EVENT_FROM_ROW = EVENT_FROM_ROW.format(at="?", id="?")
SQLITE_EVENT_VALUES = EVENT_VALUES.format(marks="?, ?, ?, ?, ?")
PG_EVENT_FROM_ROW = EVENT_FROM_ROW.format(at="$1", id="$2")
PG_EVENT_VALUES = EVENT_VALUES.format(marks="$1, $2, $3, $4, $5")


def events_of(where: Any) -> Any:
    """An event for each job matching `where`, in its current state (a Core statement)."""
    c = JOBS.c
    at = literal(utcnow(), JOB_EVENTS.c.at.type)
    rows = select(c.owner_iss, c.owner_sub, c.id, c.state, at).where(where)
    columns = ["owner_iss", "owner_sub", "job_id", "state", "at"]
    return insert(JOB_EVENTS).from_select(columns, rows)


class Logged:
    """A write that adds job events: PostgreSQL's writer takes EVENTS_LOCK before a transaction
    holding one (api/store/postgres.py)."""

    def __init__(self, write: Write) -> None:
        self.write = write

    def __call__(self, conn: Any) -> Any:
        return self.write(conn)


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One event of the log, with the job as it is now (without its output)."""

    seq: int
    state: str
    at: datetime
    job: JobRow


class PortalStore:
    """The mixin of `Store` for events and handles: it needs only the read engine."""

    def _started(self) -> AsyncEngine:
        raise NotImplementedError

    @property
    def transactions(self) -> Transactions:
        """The store's transactions outside the job writer (api/store/shielded.py)."""
        raise NotImplementedError

    # ---- the event log

    async def events_after(self, owner: tuple[str, str], after: int, limit: int) -> list[JobEvent]:
        """The identity's events with seq > `after`, oldest first, each with its job (events of
        jobs pruned since are left out)."""
        e = JOB_EVENTS.c
        query = (
            select(e.seq.label("_seq"), e.state.label("_state"), e.at.label("_at"), *LISTED)
            .join(JOBS, JOBS.c.id == e.job_id)
            .where(e.owner_iss == owner[0], e.owner_sub == owner[1], e.seq > after)
            .order_by(e.seq)
            .limit(limit)
        )
        async with self._started().connect() as conn:
            rows = [dict(r._mapping) for r in await conn.execute(query)]
        events = []
        for row in rows:
            seq, state, at = row.pop("_seq"), row.pop("_state"), row.pop("_at")
            events.append(JobEvent(int(seq), state, aware(at) or at, JobRow(**row)))
        return events

    async def event_bounds(self) -> tuple[int, int] | None:
        """The lowest and highest seq kept; None when the log is empty."""
        query = select(func.min(JOB_EVENTS.c.seq), func.max(JOB_EVENTS.c.seq))
        async with self._started().connect() as conn:
            low, high = (await conn.execute(query)).one()
        return None if low is None else (int(low), int(high))

    async def prune_events(self, before: datetime) -> int:
        """Forget the events older than `before` (the feed's resume window)."""
        query = delete(JOB_EVENTS).where(JOB_EVENTS.c.at < before)
        return await self.transactions.rowcount(query)

    # ---- job handles

    async def add_handle(self, handle: JobHandle) -> None:
        values = {name: getattr(handle, name) for name in JOB_HANDLES.c.keys()}  # noqa: SIM118
        await self.transactions.rowcount(insert(JOB_HANDLES).values(**values))

    async def handle_by_digest(self, digest: str) -> JobHandle | None:
        query = select(JOB_HANDLES).where(JOB_HANDLES.c.digest == digest)
        handles = await self._handles(query)
        return handles[0] if handles else None

    async def handles_of(self, job_id: str) -> list[JobHandle]:
        query = select(JOB_HANDLES).where(JOB_HANDLES.c.job_id == job_id)
        return await self._handles(query.order_by(JOB_HANDLES.c.created_at))

    async def drop_handle(self, job_id: str, handle_id: str) -> bool:
        """Delete one handle of a job; False when there is none of that id."""
        h = JOB_HANDLES.c
        query = delete(JOB_HANDLES).where(h.job_id == job_id, h.id == handle_id)
        return bool(await self.transactions.rowcount(query))

    async def drop_handles(
        self, *, owner: tuple[str, str] | None = None, expired_before: datetime | None = None
    ) -> int:
        """Delete every handle an identity created, or every one expired before a time."""
        h = JOB_HANDLES.c
        query = delete(JOB_HANDLES)
        if owner is not None:
            query = query.where(h.owner_iss == owner[0], h.owner_sub == owner[1])
        if expired_before is not None:
            query = query.where(h.expires_at < expired_before)
        return await self.transactions.rowcount(query)

    async def _handles(self, query: Any) -> list[JobHandle]:
        async with self._started().connect() as conn:
            rows = [dict(r._mapping) for r in await conn.execute(query)]
        for row in rows:
            row["created_at"] = aware(row["created_at"])
            row["expires_at"] = aware(row["expires_at"])
        return [JobHandle(**row) for row in rows]
