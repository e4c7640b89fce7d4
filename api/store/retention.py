"""`sshapi db prune` (docs/deploy.md): the retention of job rows, webhook deliveries, job events
and job handles, on an engine of its own (a command, not the API process)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import create_async_engine

from api.states import FINAL
from api.store.schema import JOB_EVENTS, JOB_HANDLES, JOBS, WEBHOOK_DELIVERIES, utcnow


async def prune(url: str, schema: str | None, ended_before: datetime) -> int:
    """Delete the jobs that ended before `ended_before` (and the webhook deliveries made or
    given up before then); returns how many jobs. Final jobs only: an
    active job stays whatever its age. A job row keeps up to the policy's max_output of each
    stream, so without this the table only grows (`sshapi db prune`, docs/deploy.md). Safe
    while replicas run: they never write a final row again."""
    kwargs: dict[str, Any] = {}
    if schema and not url.startswith("sqlite"):
        kwargs["connect_args"] = {"server_settings": {"search_path": schema}}
    engine = create_async_engine(url, **kwargs)
    try:
        c = JOBS.c
        query = delete(JOBS).where(c.state.in_(FINAL), c.finished_at < ended_before)
        # Webhook deliveries made or given up before then go too (pending ones stay: a
        # receiver may still come back within their retry window).
        d = WEBHOOK_DELIVERIES.c
        deliveries = delete(WEBHOOK_DELIVERIES).where(
            d.status != "pending", d.created_at < ended_before.timestamp()
        )
        async with engine.begin() as conn:
            await conn.execute(deliveries)
            # Job events of then go too, and expired job handles whatever their job.
            await conn.execute(delete(JOB_EVENTS).where(JOB_EVENTS.c.at < ended_before))
            await conn.execute(delete(JOB_HANDLES).where(JOB_HANDLES.c.expires_at < utcnow()))
            return int((await conn.execute(query)).rowcount)
    finally:
        await engine.dispose()
