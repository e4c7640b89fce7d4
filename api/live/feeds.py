"""Feeds: what followers of one job read. Per stream, the head (the first `max_output` bytes,
what the job keeps) and a window of the latest bytes; followers are cursors (byte offsets) into
it, never copies. Appending never waits (see api/live/__init__.py for the whole picture)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from api.output import Stream
from api.store import JobRow

STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")
READ = 64 << 10  # the most one follower step returns per stream from the feed itself
# Latest bytes kept per stream for followers (trimmed at twice that); a batch job's: READ_AHEAD.
WINDOW = 256 << 10
BATCH_READ = 1 << 20  # the most one remote read of a batch job's file returns
# A batch job's file is read ahead of its leading follower by at most this much (its feed keeps
# that window, so the leading follower never reads from the file itself); the watcher reads
# again once that follower is within half of it, so each read brings at least half of it.
READ_AHEAD = BATCH_READ


class OutputGone(Exception):
    """The bytes at `offset` were not kept (past the head, before the window)."""

    def __init__(self, stream: Stream, offset: int, next_offset: int) -> None:
        super().__init__(f"{stream} bytes {offset}..{next_offset} were not kept")
        self.stream = stream
        self.offset = offset
        self.next_offset = next_offset


class StreamBuffer:
    """One stream of one job: the head (first `cap` bytes) and a window of the latest bytes;
    `complete` once no more bytes will come."""

    __slots__ = ("cap", "complete", "head", "tail", "tail_start", "total", "window")

    def __init__(self, cap: int, window: int = WINDOW, start: int = 0) -> None:
        self.cap = cap
        self.window = window
        self.head = bytearray()
        self.tail = bytearray()
        self.tail_start = start
        self.total = start
        self.complete = False

    def append(self, data: bytes) -> None:
        if len(self.head) < self.cap:  # then every byte so far is in the head: it goes on
            self.head += data[: self.cap - len(self.head)]
        self.tail += data
        self.total += len(data)
        if len(self.tail) > 2 * self.window:  # trimming at 2x keeps the copying amortised O(1)
            drop = len(self.tail) - self.window
            del self.tail[:drop]
            self.tail_start += drop

    def read(self, offset: int, limit: int = READ) -> bytes | None:
        """The kept bytes from `offset` (empty: none yet; None: not kept)."""
        if offset >= self.tail_start:
            at = offset - self.tail_start
            return bytes(self.tail[at : at + limit])
        if offset < len(self.head):
            return bytes(self.head[offset : min(len(self.head), offset + limit)])
        return None

    def skip_to(self, offset: int) -> None:
        """The bytes up to `offset` will never come (a relayed stream that jumped): the window
        restarts there, and the head, being the first bytes only, grows no more."""
        self.cap = len(self.head)
        self.tail = bytearray()
        self.tail_start = self.total = offset

    def lagging(self, offset: int) -> bool:
        """True when a cursor at `offset` has fallen out of the window and past the head."""
        return len(self.head) <= offset < self.tail_start


# A batch job's file, read again from an offset out of the window: (stream, offset, limit).
Refill = Callable[[Stream, int, int], Awaitable[bytes]]
# Spend one read token of a follower's identity: 0 when spent, else the seconds to wait first.
Spend = Callable[[], Awaitable[float]]


async def free() -> float:
    """The spend of a follower whose reads cost no SSH (tests, tools): always granted."""
    return 0.0


class Cursor:
    """One follower of a feed: its offsets (the dict `follow` advances as its client takes the
    bytes) and how the SSH reads made for it are paid."""

    __slots__ = ("offsets", "spend")

    def __init__(self, offsets: dict[Stream, int], spend: Spend) -> None:
        self.offsets = offsets
        self.spend = spend

    async def pay(self) -> None:
        """One read token, waiting while the identity is beyond its rate (a bucket refills
        with time: there is no event to wait for)."""
        while (wait := await self.spend()) > 0:  # noqa: ASYNC110
            await asyncio.sleep(wait)


class Feed:
    """What followers of one job read: its row (state), its streams, one wake-up event; and,
    for a batch job's watcher, its followers' cursors and a demand event they set."""

    def __init__(
        self, row: JobRow, cap: int, refill: Refill | None = None, window: int = WINDOW
    ) -> None:
        self.row = row
        self.streams = {s: StreamBuffer(cap, window) for s in STREAMS}
        self.final = False
        self.followers = 0
        self._wake = asyncio.Event()
        # Batch jobs: bytes out of the window are read again from the file.
        self.refill = refill
        self.cursors: set[Cursor] = set()
        self._demand = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        return self._wake

    def advanced(self) -> None:
        """A follower moved (or came or went): the watcher looks whether to read ahead."""
        self._demand.set()
        self._demand = asyncio.Event()

    def demand(self) -> asyncio.Event:
        return self._demand

    def lead(self, stream: Stream) -> Cursor | None:
        """The follower of `stream` furthest ahead (None: nobody follows it)."""
        return max(
            (c for c in self.cursors if stream in c.offsets),
            key=lambda c: c.offsets[stream],
            default=None,
        )

    def append(self, stream: Stream, data: bytes) -> None:
        """The pool's on_output hook: cheap and never blocking (see `Capture`)."""
        self.streams[stream].append(data)
        self.wake()

    def update(self, row: JobRow) -> None:
        self.row = row
        self.wake()

    def finish(self, row: JobRow) -> None:
        self.row = row
        self.final = True
        for buf in self.streams.values():
            buf.complete = True
        self.wake()

    async def read(self, stream: Stream, offset: int, cursor: Cursor | None = None) -> bytes:
        """The bytes at `offset`: from the buffer, else (a batch job) from the file, paid by
        `cursor`'s identity."""
        buf = self.streams[stream]
        data = buf.read(offset)
        if data is not None:
            return data
        if self.refill is None:
            raise OutputGone(stream, offset, buf.tail_start)
        await (cursor or Cursor({}, free)).pay()
        return await self.refill(stream, offset, BATCH_READ)


def kept(row: JobRow, stream: Stream) -> bytes:
    """The output the job keeps (its head)."""
    return (row.stdout if stream == "stdout" else row.stderr) or b""


def head_of(row: JobRow, stream: Stream) -> StreamBuffer:
    """A finished command's stream: the kept head, then nothing until the count of all bytes."""
    head = kept(row, stream)
    total = (row.stdout_bytes if stream == "stdout" else row.stderr_bytes) or len(head)
    buf = StreamBuffer(len(head), start=max(total, len(head)))
    buf.head += head
    return buf


def stored(row: JobRow) -> Feed:
    """A finished command's feed: its kept output, final."""
    feed = Feed(row, 0)
    for stream in STREAMS:
        feed.streams[stream] = head_of(row, stream)
    feed.finish(row)
    return feed
