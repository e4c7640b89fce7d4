"""For portals (docs/portals.md): job handles (`/v1/jobs/{id}/handles`) and the change feed
(`GET /v1/jobs/events`). Included before the jobs router, so that `/v1/jobs/events` is this feed
and not a job of id "events"."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Principal
from api.deps import Caller, Reader, Svc
from api.policy import host_details
from api.problems import MEDIA_TYPE, Problem
from api.routes.live import NO_BUFFERING, FollowResponse, job_summary

router = APIRouter(prefix="/v1/jobs", tags=["portals"])

EVENT_ID = re.compile(r"[0-9]{1,18}")  # a seq: below 2**63 whatever its digits


def _problem(description: str) -> dict[str, Any]:
    return {"description": description, "content": {MEDIA_TYPE: {}}}


class HandleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl: float = Field(
        gt=0, le=1e9, description="Seconds the handle lives; cut to the policy's handle_max_ttl."
    )
    cancel: bool = Field(default=False, description="The handle may cancel the job too.")


class HandleInfo(BaseModel):
    id: str = Field(description="Names the handle in `DELETE /v1/jobs/{id}/handles/{handle_id}`.")
    job_id: str
    cancel: bool
    created_at: datetime
    expires_at: datetime


class HandleCreated(HandleInfo):
    handle: str = Field(description="The bearer token: shown once, never stored.")


class HandleList(BaseModel):
    items: list[HandleInfo]


def not_for_handles(who: Principal, what: str) -> None:
    if who.handle is not None:
        raise Problem(403, "handle-not-allowed", "Not with a handle",
                      f"a job handle reads its job only; {what} needs a token")  # fmt: skip


@router.post(
    "/{job_id}/handles",
    status_code=201,
    response_model=HandleCreated,
    responses={
        401: _problem("Missing or invalid token."),
        403: _problem("A handle making a handle, or `cancel` without `jobs:write`."),
        404: _problem("No such job (or not yours)."),
        422: _problem("Invalid body (ttl at most 1e9 seconds)."),
        429: _problem("The job has `max_handles_per_job` unexpired handles."),
    },
    summary="Make a handle: a bearer token that reads this job only",
)
async def create_handle(job_id: str, body: HandleRequest, who: Reader, svc: Svc) -> HandleCreated:
    not_for_handles(who, "making a handle")
    if body.cancel and not who.has("jobs:write"):
        raise Problem(403, "insufficient-scope", "Insufficient scope",
                      "a handle that may cancel needs the 'jobs:write' scope")  # fmt: skip
    row = await svc.jobs.get(who, job_id)
    token, handle = await svc.handles.create(who, row, body.ttl, body.cancel)
    return HandleCreated(
        id=handle.id,
        job_id=handle.job_id,
        cancel=handle.cancel,
        created_at=handle.created_at,
        expires_at=handle.expires_at,
        handle=token,
    )


@router.get(
    "/{job_id}/handles",
    response_model=HandleList,
    responses={404: _problem("No such job (or not yours).")},
    summary="The job's handles (never their tokens)",
)
async def list_handles(job_id: str, who: Reader, svc: Svc) -> HandleList:
    not_for_handles(who, "listing handles")
    row = await svc.jobs.get(who, job_id)
    handles = await svc.handles.of(row)
    fields = ("id", "job_id", "cancel", "created_at", "expires_at")
    return HandleList(items=[HandleInfo(**{k: getattr(h, k) for k in fields}) for h in handles])


@router.delete(
    "/{job_id}/handles/{handle_id}",
    status_code=204,
    response_class=Response,
    responses={404: _problem("No such job or handle (or not yours).")},
    summary="Revoke a handle: its next request is 401",
)
async def delete_handle(job_id: str, handle_id: str, who: Caller, svc: Svc) -> Response:
    """By its creator (or an admin), or by the handle itself (its own id only)."""
    if who.handle is not None and who.handle.id != handle_id:
        raise Problem(404, "handle-not-found", "No such handle", "a handle deletes only itself")
    row = await svc.jobs.get(who, job_id)
    if not await svc.handles.drop(row, handle_id):
        raise Problem(404, "handle-not-found", "No such handle", f"no handle {handle_id!r}")
    return Response(status_code=204)


def sse(event: str, seq: int, data: Any) -> bytes:
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"id: {seq}\nevent: {event}\ndata: {body}\n\n".encode()


FEED_DOC = """Server-Sent Events, one per state change of any of your jobs (`queued`, `running`,
then its final state), in commit order on every replica. Each event's `event` is
`job.<state>` (`job.running`, `job.succeeded`, ...), its `id` the change's sequence number
(reconnect with `Last-Event-ID` to resume without loss), its `data`
`{"type": "job.<state>", "timestamp": <when the change was committed>, "data": <the job as it is
when sent, without its output>}`. First comes `ready` (`id`: where this feed starts); `reset`
(`{"detail"}`) when a `Last-Event-ID` is older than the kept window or not one we gave: some
changes may be missed, list your jobs again; `revoked` ends the feed when an administrator
revokes you; a comment (`: keep-alive`) every `change_keepalive` seconds while nothing
changes."""


@router.get(
    "/events",
    responses={
        200: {"content": {"text/event-stream": {}}, "description": FEED_DOC},
        403: _problem("Scope missing, or a job handle (which reads its job only)."),
        422: _problem("A malformed `Last-Event-ID`."),
        429: _problem("`max_change_feeds` feeds of yours are open already."),
    },
    response_class=StreamingResponse,  # the documented class (FollowResponse is one)
    summary="Your jobs' state changes, as one Server-Sent Events stream",
)
async def change_feed(
    who: Reader,
    svc: Svc,
    last_event_id: Annotated[
        str | None, Header(max_length=64, description="Resume after this event id.")
    ] = None,
) -> Any:
    not_for_handles(who, "the change feed")
    after: int | None = None
    if last_event_id is not None:
        if not EVENT_ID.fullmatch(last_event_id.strip()):
            raise Problem(422, "invalid-event-id", "Invalid Last-Event-ID",
                          "send the id of an event of this feed: a decimal number")  # fmt: skip
        after = int(last_event_id.strip())
    bounds = await svc.changes.bounds()
    reset = False
    if after is None:
        after = bounds[1] if bounds else 0
    elif bounds is None:
        reset = after > 0  # every event was pruned (or the id was never ours)
    elif after > bounds[1]:
        reset, after = True, bounds[1]  # not an id we gave: go on from now
    elif after < bounds[0] - 1:
        reset = True  # older than the window: what is kept follows
    admitted = svc.changes.admitted(who.key)
    feed_id = await admitted.__aenter__()
    start = after

    async def body() -> AsyncIterator[bytes]:
        if reset:
            detail = "some changes before this point were not kept: list your jobs again"
            yield sse("reset", start, {"detail": detail})
        yield sse("ready", start, {"last_event_id": start})
        details = host_details(who, svc.config.api)
        stop = svc.revocations.stops(who)
        last = start
        async for page in svc.changes.events(who.key, start, stop, feed_id):
            if page is None:
                yield b": keep-alive\n\n"
                continue
            for event in page:
                kind = f"job.{event.state}"
                data = {"type": kind, "timestamp": event.at.isoformat(),
                        "data": job_summary(event.job, details)}  # fmt: skip
                yield sse(kind, event.seq, data)
                last = event.seq
        if stop():
            yield sse("revoked", last, {"detail": "an administrator revoked your access"})

    async def release() -> None:
        await admitted.__aexit__(None, None, None)

    return FollowResponse(body(), release, media_type="text/event-stream", headers=NO_BUFFERING)
