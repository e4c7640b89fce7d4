"""Followers: one client's cursor moving through a feed (`follow`), what it yields (output,
state changes, gaps, a cut-off, keep-alives, a stop), and the offsets of `/events`
(`Last-Event-ID`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from api.live.feeds import Cursor, Feed, OutputGone, Spend, free
from api.numbers import read_count
from api.output import Stream
from api.store import JobRow

KEEPALIVE = 15.0  # seconds of silence before a follower yields a keep-alive


@dataclass(frozen=True, slots=True)
class Output:
    stream: Stream
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StateChange:
    row: JobRow


@dataclass(frozen=True, slots=True)
class Gap:
    """Bytes [offset, next_offset) of `stream` were not kept; following goes on after them."""

    stream: Stream
    offset: int
    next_offset: int


@dataclass(frozen=True, slots=True)
class Cutoff:
    """This follower fell too far behind; resume from `offset` (a new request)."""

    stream: Stream
    offset: int


@dataclass(frozen=True, slots=True)
class KeepAlive:
    pass


@dataclass(frozen=True, slots=True)
class Stopped:
    """`stop` said so (the follower's identity was revoked): the last item."""


Item = Output | StateChange | Gap | Cutoff | KeepAlive | Stopped


def never() -> bool:
    """The `stop` of a follower nothing stops but the job's end (tests, tools)."""
    return False


async def follow(
    feed: Feed,
    offsets: dict[Stream, int],
    *,
    states: bool = True,
    gaps: bool = True,
    keepalive: float = KEEPALIVE,
    spend: Spend = free,
    stop: Callable[[], bool] = never,
) -> AsyncIterator[Item]:
    """Follow `feed` from `offsets` (one entry per stream followed) until the job is final and
    every byte kept has been yielded. Yields output, state changes (with `states`), a Gap for
    bytes not kept at a resumed offset (without `gaps`: raises OutputGone instead), KeepAlive
    after `keepalive` seconds of silence, and a final Cutoff when this follower lagged out of
    the window. `spend` pays for the SSH reads made for this follower (a batch job's). `stop`
    is asked before every step and whenever the feed wakes (`LiveHub.wake_all` wakes every
    feed): once true, a final Stopped."""
    cursor = Cursor(offsets, spend)
    feed.cursors.add(cursor)
    feed.advanced()
    try:
        async for item in _follow(feed, cursor, states, gaps, keepalive, stop):
            yield item
    finally:
        feed.cursors.discard(cursor)
        feed.advanced()


async def _follow(
    feed: Feed,
    cursor: Cursor,
    states: bool,
    gaps: bool,
    keepalive: float,
    stop: Callable[[], bool],
) -> AsyncIterator[Item]:
    offsets = cursor.offsets
    sent_state: str | None = None
    live: set[Stream] = set()  # streams whose cursor reached the window (not only the head)
    while True:
        waiter = feed.waiter()
        if stop():
            yield Stopped()
            return
        # Read before the bytes: a complete stream gets no more of them.
        final = all(feed.streams[s].complete for s in offsets)
        progressed = False
        if states and feed.row.state != sent_state:
            sent_state = feed.row.state
            yield StateChange(feed.row)
        for stream, offset in list(offsets.items()):
            buf = feed.streams[stream]
            if stream in live and buf.lagging(offset) and feed.refill is None:
                yield Cutoff(stream, offset)
                return
            if offset >= buf.tail_start:
                live.add(stream)
            try:
                data = await feed.read(stream, offset, cursor)
            except OutputGone as exc:
                if not gaps:
                    raise
                yield Gap(stream, offset, exc.next_offset)
                offsets[stream] = exc.next_offset
                progressed = True
                continue
            if data:
                offsets[stream] = offset + len(data)
                progressed = True
                feed.advanced()
                yield Output(stream, offset, data)
        if progressed:
            continue
        if final:
            if states and feed.row.state != sent_state:
                yield StateChange(feed.row)
            return
        try:
            async with asyncio.timeout(keepalive):
                await waiter.wait()
        except TimeoutError:
            yield KeepAlive()


def parse_event_id(value: str) -> dict[Stream, int] | None:
    """`Last-Event-ID` of /events: "<stdout offset>-<stderr offset>"; None if malformed."""
    out, sep, err = value.strip().partition("-")
    stdout, stderr = read_count(out), read_count(err)
    if not sep or stdout is None or stderr is None:
        return None
    return {"stdout": stdout, "stderr": stderr}


def event_id(offsets: dict[Stream, int]) -> str:
    return f"{offsets['stdout']}-{offsets['stderr']}"


def text_boundary(data: bytes) -> int:
    """The length of `data` that ends on a UTF-8 character boundary (at most 3 bytes held back),
    so that an event's text never splits a character; offsets stay byte offsets."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        if byte >= 0xC0:  # a lead byte: does its sequence fit in what we have?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if need > back else len(data)
        return len(data)
    return len(data)
