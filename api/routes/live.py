"""Live output over HTTP: `GET /v1/jobs/{id}/output?follow=true` (raw bytes, chunked) and
`GET /v1/jobs/{id}/events` (Server-Sent Events). The feeds and their rules are api/live/."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.deps import Reader, Svc
from api.live import (
    STREAMS,
    Cutoff,
    Feed,
    Gap,
    KeepAlive,
    Output,
    OutputGone,
    StateChange,
    Stopped,
    event_id,
    follow,
    parse_event_id,
    text_boundary,
)
from api.output import Stream
from api.policy import host_details
from api.problems import MEDIA_TYPE, Problem
from api.schemas import Job
from api.store import JobRow

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

# Proxies (nginx) must pass each chunk on at once; nothing here may be cached.
NO_BUFFERING = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


class FollowResponse(StreamingResponse):
    """A streaming response that releases what its follower holds (the follower count, the
    feed) however the response ends: finished, client gone, server shutting down."""

    def __init__(
        self, body: AsyncIterator[bytes], release: Callable[[], Awaitable[Any]], **kw: Any
    ) -> None:
        super().__init__(body, **kw)
        self._body = body
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self._body.aclose()  # type: ignore[attr-defined]
            await self._release()


def not_kept(exc: OutputGone) -> Problem:
    return Problem(
        416,
        "output-not-kept",
        "Output not kept",
        f"{exc.stream} bytes from {exc.offset} to {exc.next_offset} were not kept (past the "
        f"policy's max_output and no longer in the live window); follow from {exc.next_offset}",
        next_offset=exc.next_offset,
    )


async def start_following(
    svc: Svc, who: Reader, job_id: str
) -> tuple[Feed, Any, Callable[[], bool]]:
    """Enter the follower's context now, so 404 and 429 are answered before any byte. Also
    returns when the follower must stop: its caller revoked, or its job handle gone."""
    stack = contextlib.AsyncExitStack()
    try:
        feed = await stack.enter_async_context(svc.jobs.following(who, job_id))
        handle_gone = await stack.enter_async_context(svc.handles.watching(who, feed.wake))
    except BaseException:
        await stack.aclose()
        raise
    revoked = svc.revocations.stops(who)
    return feed, stack, lambda: revoked() or handle_gone()


async def follow_output(svc: Svc, who: Reader, job_id: str, stream: Stream, offset: int) -> Any:
    """The body of `output?follow=true`: the bytes of one stream from `offset` as they arrive,
    until the job is final (or this follower fell out of the window: then the body just ends
    early, and the client resumes with the offset it reached)."""
    feed, stack, stop = await start_following(svc, who, job_id)
    try:
        if feed.refill is None and feed.streams[stream].read(offset) is None:
            raise not_kept(OutputGone(stream, offset, feed.streams[stream].tail_start))
    except BaseException:
        await stack.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        # Trimmed since the check, or revoked (Stopped): the body ends; resuming from the
        # offset reached says which (a 416, a 403 identity-revoked).
        with contextlib.suppress(OutputGone):
            spend = svc.jobs.read_spend(who)
            items = follow(feed, {stream: offset}, states=False, gaps=False, spend=spend, stop=stop)
            async for item in items:
                if isinstance(item, Output):
                    yield item.data

    return FollowResponse(
        body(),
        stack.aclose,
        media_type="application/octet-stream",
        headers={**NO_BUFFERING, "X-Output-Offset": str(offset)},
    )


def sse(event: str | None, data: Any, offsets: dict[Stream, int] | None = None) -> bytes:
    lines = []
    if offsets is not None:
        lines.append(f"id: {event_id(offsets)}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append("data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")))
    return ("\n".join(lines) + "\n\n").encode()


def job_summary(row: JobRow, details: bool) -> dict[str, Any]:
    """A state event's data: the job without its (possibly large) kept output."""
    return Job.of(row, details).model_dump(mode="json", exclude={"stdout", "stderr"})


EVENTS_DOC = """Server-Sent Events: `state` (the job without its output, at the start and on
every change), `output` (`{"stream", "offset", "bytes", "text"}`: UTF-8, invalid bytes replaced,
a character never split across events), `gap` (`{"stream", "offset", "next_offset"}`: bytes not
kept), `cutoff` (this follower fell behind the live window; reconnect to resume), `revoked`
(`{"detail"}`: an administrator revoked the caller's access; the last event) and `end` (the
job is final and every kept byte was sent). Every event's `id` is `<stdout offset>-<stderr
offset>` after it: reconnecting with `Last-Event-ID` resumes without loss or duplicates."""


@router.get(
    "/{job_id}/events",
    responses={
        200: {"content": {"text/event-stream": {}}, "description": EVENTS_DOC},
        404: {"description": "No such job (or not yours).", "content": {MEDIA_TYPE: {}}},
        416: {"description": "An offset whose bytes were not kept.", "content": {MEDIA_TYPE: {}}},
        422: {"description": "A malformed `Last-Event-ID`.", "content": {MEDIA_TYPE: {}}},
        429: {"description": "Too many live followers.", "content": {MEDIA_TYPE: {}}},
    },
    response_class=StreamingResponse,
    summary="Follow a job: state changes and output as Server-Sent Events",
)
async def job_events(
    job_id: str,
    who: Reader,
    svc: Svc,
    last_event_id: Annotated[
        str | None, Header(max_length=64, description="Resume after this event id.")
    ] = None,
    stdout_offset: Annotated[int, Query(ge=0)] = 0,
    stderr_offset: Annotated[int, Query(ge=0)] = 0,
) -> Any:
    offsets: dict[Stream, int] = {"stdout": stdout_offset, "stderr": stderr_offset}
    if last_event_id is not None:
        parsed = parse_event_id(last_event_id)
        if parsed is None:
            raise Problem(
                422,
                "invalid-event-id",
                "Invalid Last-Event-ID",
                "send the id of an event of this stream: <stdout offset>-<stderr offset>",
            )
        offsets = parsed
    feed, stack, stop = await start_following(svc, who, job_id)

    async def body() -> AsyncIterator[bytes]:
        sent = dict(offsets)  # bytes sent per stream: the event ids
        held: dict[Stream, bytes] = {s: b"" for s in STREAMS}  # a split UTF-8 character

        def output(stream: Stream, data: bytes, flush: bool) -> bytes:
            data = held[stream] + data
            cut = len(data) if flush else text_boundary(data)
            held[stream] = data[cut:]
            if not cut:
                return b""
            start = sent[stream]
            sent[stream] = start + cut
            text = data[:cut].decode("utf-8", "replace")
            payload = {"stream": stream, "offset": start, "bytes": cut, "text": text}
            return sse("output", payload, sent)

        spend = svc.jobs.read_spend(who)
        details = host_details(who, svc.config.api)
        async for item in follow(feed, dict(offsets), spend=spend, stop=stop):
            if isinstance(item, Output):
                if chunk := output(item.stream, item.data, flush=False):
                    yield chunk
            elif isinstance(item, StateChange):
                yield sse("state", job_summary(item.row, details), sent)
            elif isinstance(item, Gap):
                if chunk := output(item.stream, b"", flush=True):
                    yield chunk
                sent[item.stream] = item.next_offset
                yield sse("gap", {"stream": item.stream, "offset": item.offset,
                                  "next_offset": item.next_offset}, sent)  # fmt: skip
            elif isinstance(item, Cutoff):
                detail = "this follower fell behind the live output; reconnect to resume"
                payload = {"stream": item.stream, "offset": sent[item.stream], "detail": detail}
                yield sse("cutoff", payload, sent)
                return
            elif isinstance(item, KeepAlive):
                yield b": keep-alive\n\n"
            elif isinstance(item, Stopped):
                detail = "an administrator revoked your access"  # as a request's 403 says
                if who.handle is not None:  # its next request is 401
                    detail = "this job handle was deleted, expired or its creator revoked"
                yield sse("revoked", {"detail": detail}, sent)
                return
        for stream in STREAMS:
            if chunk := output(stream, b"", flush=True):
                yield chunk
        yield sse("end", {"state": feed.row.state}, sent)

    return FollowResponse(
        body(), stack.aclose, media_type="text/event-stream", headers=NO_BUFFERING
    )
