"""The webhook outbox's one write that rides along a job's state change: an INSERT ... SELECT
that adds a delivery row for each of the job owner's webhooks subscribed to the event, run in
the transaction of the UPDATE that changed the state (api/store/store.py), so that a state change
and its deliveries commit together or not at all; `ON CONFLICT DO NOTHING` on the event's
fixed id (per job and state) keeps a repeated write of one state from announcing it twice. With
no webhook it inserts nothing: the cost per state change is one indexed lookup on the webhooks
table.

The same statement for the three writers: SQLite's DB-API (`?n`), asyncpg (`$n`) and SQLAlchemy
Core text (`:pn`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from api.store.schema import JOBS, WEBHOOK_DELIVERIES, WEBHOOKS

# The namespace of event ids (uuid5 of "<job id>/<type>"): any constant of our own.
EVENTS = uuid.UUID("5b1d3c6e-43a0-4c1e-9f7a-0e8d2b6a4c43")
# The states whose reaching is an event (`job.<state>`); `queued` is the job's creation.
EVENT_STATES = ("running", "succeeded", "failed", "timed_out", "cancelled", "lost", "error")


def _sql(mark: Callable[[int], str]) -> str:
    event, kind, now, job, like = (f"CAST({mark(n)} AS {t})" for n, t in _TYPES)
    return (
        f"INSERT INTO {WEBHOOK_DELIVERIES.name} (id, event_id, webhook_id, owner_iss, owner_sub, "
        "job_id, type, created_at, next_at, attempts, status) "
        f"SELECT {event} || ':' || w.id, {event}, w.id, w.owner_iss, w.owner_sub, j.id, {kind}, "
        f"{now}, {now}, 0, 'pending' FROM {WEBHOOKS.name} w JOIN {JOBS.name} j "
        "ON w.owner_iss = j.owner_iss AND w.owner_sub = j.owner_sub "
        f"WHERE j.id = {job} AND w.events LIKE {like} ON CONFLICT DO NOTHING"
    )


_TYPES = ((1, "VARCHAR(36)"), (2, "VARCHAR(32)"), (3, "FLOAT"), (4, "VARCHAR(36)"), (5, "TEXT"))
SQLITE = _sql(lambda n: f"?{n}")
POSTGRES = _sql(lambda n: f"${n}")
CORE = _sql(lambda n: f":p{n}")


def params(job_id: str, values: dict[str, Any]) -> list[Any] | None:
    """The statement's parameters for an update of `job_id` setting `values`; None when the
    update is no event (no state, or `queued`)."""
    state = values.get("state")
    if not isinstance(state, str) or state not in EVENT_STATES:
        return None
    return event_params(job_id, state)


def event_params(job_id: str, state: str) -> list[Any]:
    """The event's id is the job's and the state's (a UUIDv5): a job reaches each state once,
    so an update that writes the state it already has (a batch job's scheduler state changing
    within `running`) finds its deliveries there already and adds none."""
    kind = f"job.{state}"
    event_id = str(uuid.uuid5(EVENTS, f"{job_id}/{kind}"))
    return [event_id, kind, time.time(), job_id, f"%,{kind},%"]


def core_params(positional: list[Any]) -> dict[str, Any]:
    return {f"p{n}": value for n, value in enumerate(positional, 1)}
