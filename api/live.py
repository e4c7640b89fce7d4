"""Live output: many followers per job, none of which can slow the job down.

One `Feed` per followed job in this process holds, per stream, the head (the first `max_output`
bytes, what the job keeps) and a window of the latest bytes; followers are cursors (byte
offsets) into it, never copies:

    pool drain --on_output--> Feed.append --wake--> follower 1 ... follower N --> HTTP body

- Appending never waits: it copies the chunk into the window, trims the window (amortised, at
  twice its size) and sets one event. A follower whose client reads slowly only blocks its own
  HTTP send (uvicorn's flow control); once its cursor falls out of the window and past the head
  it is cut off with a `cutoff` event naming its offset, and resumes by offset (from the window
  or the head, else a `gap` event says which bytes were not kept).
- A follower that disconnects is just a cursor that goes away: the job never sees it.

Where the bytes come from:
- a command run by this replica: its channel, through `Pool.run(on_output=)`; the Feed exists
  from the submit on, so a follower arriving late still reads from byte 0 (the head), and a
  follower past the cap still sees the live stream (the job keeps only the head; `*_bytes`
  counts everything, so `stdout_bytes - len(stdout)` bytes were not kept).
- a batch job: its output files, read over SSH by one watcher task per job in this process
  however many clients follow it, in ranges, until the scheduler reports the job final and the
  files are read to their end; a follower behind the window reads its range from the file
  itself. The watcher reads ahead only while the leading follower of a stream is within
  READ_AHEAD of what was read: a follower whose client stops reading stops the reads (its
  cursor stays where its client's flow control holds it), so a finished output of any size
  costs SSH reads in step with what its followers' clients take, not with its size. Every such
  read takes a token of the follower's identity ("reads" bucket: the rule's rate and burst, as
  output reads do): the leading follower's for the watcher's reads, its own for a read from
  behind the window. A follower beyond its rate waits for its next token: a slower stream, not
  an error (it is an answer already under way, and a researcher watching output expects it to
  go on).
- a command run by another replica (several replicas share PostgreSQL): its bytes live in that
  replica's memory. With Redis (SSHAPI_REDIS_URL) one watcher per job here reads them from the
  owner's capped Redis streams into a Feed of this process (api/relay.py), so followers here see
  them live, with the same cursors, cut-offs and gaps. Without Redis (or while it is down) the
  watcher polls the shared store: state changes within `POLL` seconds and the kept output (the
  head) once the job is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from api.numbers import read_count
from api.output import Stream
from api.problems import Problem, retry_after
from api.states import FINAL
from api.store import JobRow

log = logging.getLogger("sshapi.live")

STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")
READ = 64 << 10  # the most one follower step returns per stream from the feed itself
# Latest bytes kept per stream for followers (trimmed at twice that); a batch job's: READ_AHEAD.
WINDOW = 256 << 10
POLL = (0.25, 2.0)  # watcher intervals: while output flows, and the idle cap (doubling)
BATCH_READ = 1 << 20  # the most one remote read of a batch job's file returns
# A batch job's file is read ahead of its leading follower by at most this much (its feed keeps
# that window, so the leading follower never reads from the file itself); the watcher reads
# again once that follower is within half of it, so each read brings at least half of it.
READ_AHEAD = BATCH_READ
KEEPALIVE = 15.0  # seconds of silence before a follower yields a keep-alive
MAX_PER_JOB = 64  # followers of one job in one process


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


Item = Output | StateChange | Gap | Cutoff | KeepAlive


async def follow(
    feed: Feed,
    offsets: dict[Stream, int],
    *,
    states: bool = True,
    gaps: bool = True,
    keepalive: float = KEEPALIVE,
    spend: Spend = free,
) -> AsyncIterator[Item]:
    """Follow `feed` from `offsets` (one entry per stream followed) until the job is final and
    every byte kept has been yielded. Yields output, state changes (with `states`), a Gap for
    bytes not kept at a resumed offset (without `gaps`: raises OutputGone instead), KeepAlive
    after `keepalive` seconds of silence, and a final Cutoff when this follower lagged out of
    the window. `spend` pays for the SSH reads made for this follower (a batch job's)."""
    cursor = Cursor(offsets, spend)
    feed.cursors.add(cursor)
    feed.advanced()
    try:
        async for item in _follow(feed, cursor, states, gaps, keepalive):
            yield item
    finally:
        feed.cursors.discard(cursor)
        feed.advanced()


async def _follow(
    feed: Feed, cursor: Cursor, states: bool, gaps: bool, keepalive: float
) -> AsyncIterator[Item]:
    offsets = cursor.offsets
    sent_state: str | None = None
    live: set[Stream] = set()  # streams whose cursor reached the window (not only the head)
    while True:
        waiter = feed.waiter()
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


Load = Callable[[str], Awaitable[JobRow | None]]


class Relay(Protocol):
    """Commands' live output between replicas (api/relay.py's RedisRelay)."""

    def listen(self, wanted: Callable[[str], None]) -> None:
        """Call `wanted(job_id)` when another replica wants to follow a job."""

    async def publish(self, feed: Feed) -> None:
        """Copy a feed of this process out until it is final."""

    async def watch(self, feed: Feed, load: Load) -> None:
        """Fill a feed of another replica's command until the job is final."""

    async def close(self) -> None: ...


class LiveHub:
    """The feeds of this process: commands it runs, and watchers of the jobs it does not."""

    def __init__(
        self,
        load: Load,
        read_file: Callable[[JobRow, Stream, int, int], Awaitable[tuple[bytes, int | None]]],
        relay: Relay | None = None,
    ) -> None:
        self._load = load  # the store's row
        self._read_file = read_file  # a batch job's output file, over SSH
        self.relay = relay
        self.feeds: dict[str, Feed] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._commands: set[str] = set()  # jobs whose feed this process fills from the pool
        self._publishers: dict[str, asyncio.Task[None]] = {}

    # ---- commands run here

    def open_command(self, row: JobRow, cap: int) -> Feed:
        feed = Feed(row, cap)
        self.feeds[row.id] = feed
        self._commands.add(row.id)
        if self.relay is not None:
            self.relay.listen(self._wanted)
        return feed

    def close_command(self, row: JobRow) -> None:
        self._commands.discard(row.id)
        feed = self.feeds.pop(row.id, None)
        if feed is not None:
            feed.finish(row)

    def _wanted(self, job_id: str) -> None:
        """Another replica follows a command of ours: publish it (once per job)."""
        if self.relay is None or job_id not in self._commands or job_id in self._publishers:
            return
        task = asyncio.create_task(self.relay.publish(self.feeds[job_id]), name=f"pub-{job_id}")
        self._publishers[job_id] = task
        task.add_done_callback(lambda _: self._publishers.pop(job_id, None))

    # ---- following

    @contextlib.asynccontextmanager
    async def feed_for(self, row: JobRow) -> AsyncIterator[Feed]:
        """The feed of `row` for one follower, counted while it follows; the watcher of a job
        this process does not run stops once its last follower leaves."""
        feed = self.feeds.get(row.id)
        if feed is None:
            feed = _stored(row) if row.state in FINAL and row.kind != "batch" else self._watch(row)
        if feed.followers >= MAX_PER_JOB:
            raise Problem(
                429,
                "too-many-followers",
                "Too many followers of this job",
                f"at most {MAX_PER_JOB} followers of one job",
                headers=retry_after(5),
            )
        feed.followers += 1
        try:
            yield feed
        finally:
            feed.followers -= 1
            if feed.followers == 0 and row.id in self._watchers:
                self._watchers.pop(row.id).cancel()
                if self.feeds.get(row.id) is feed:
                    del self.feeds[row.id]

    def _watch(self, row: JobRow) -> Feed:
        if row.kind == "batch":

            async def refill(stream: Stream, offset: int, limit: int) -> bytes:
                data, _ = await self._read_file(feed.row, stream, offset, limit)
                return data

            feed = Feed(row, 0, refill, window=READ_AHEAD)
            watcher = self._read_ahead(feed)
        else:
            feed = Feed(row, 0)
            watcher = self._watcher(feed)
        self.feeds[row.id] = feed
        self._watchers[row.id] = asyncio.create_task(watcher, name=f"live-{row.id}")
        return feed

    async def _watcher(self, feed: Feed) -> None:
        """One per followed command this process does not run: polls the store for the state
        (or reads the owner's relay) until the job is final."""
        delay, cap = POLL
        try:
            if self.relay is not None:
                await self.relay.watch(feed, self._load)
                return
            while True:
                if feed.row.state in FINAL:  # another replica's command: its kept output
                    for stream in STREAMS:
                        feed.streams[stream] = head_of(feed.row, stream)
                    feed.finish(feed.row)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                with contextlib.suppress(Exception):  # the store is down: the old row meanwhile
                    fresh = await self._load(feed.row.id)
                    if fresh is not None and fresh.state != feed.row.state:
                        delay = POLL[0]
                        feed.update(fresh)
                    elif fresh is not None:
                        feed.row = fresh
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("live: watcher of job %s failed", feed.row.id)
            feed.finish(feed.row)

    async def _read_ahead(self, feed: Feed) -> None:
        """One per followed batch job in this process: reads its output files onward as its
        followers take them (see the module docstring) and its state from the store, until the
        job is final and each stream has been read to its end.

        A stream is read when its leading follower is within READ_AHEAD // 2 of what was read,
        at most up to READ_AHEAD ahead of that follower, paid by that follower's identity. An
        empty read waits POLL (doubling to its cap) before that stream is read again; nothing
        is read while no follower comes near, whatever the file's size."""
        loop = asyncio.get_running_loop()
        store_delay = POLL[0]
        load_at = loop.time() + store_delay
        empty_delay = dict.fromkeys(STREAMS, POLL[0])
        read_at = dict.fromkeys(STREAMS, 0.0)
        try:
            while True:
                demand = feed.demand()
                final = feed.row.state in FINAL  # before the reads: their bytes all came
                grew = False
                for stream in STREAMS:
                    buf = feed.streams[stream]
                    lead = feed.lead(stream)
                    if buf.complete or lead is None or loop.time() < read_at[stream]:
                        continue
                    behind = buf.total - lead.offsets[stream]
                    if behind < 0:
                        # The leader resumed past what was read: read from there; a follower
                        # that wants the bytes before reads them from the file itself.
                        buf.skip_to(lead.offsets[stream])
                        behind = 0
                    if behind > READ_AHEAD // 2:
                        continue  # the leader has not come near: nothing is read for nobody
                    await lead.pay()
                    read_ok = True
                    try:
                        data, _ = await self._read_file(
                            feed.row, stream, buf.total, READ_AHEAD - behind
                        )
                    except Exception as exc:  # the host is unreachable: try again later
                        log.info("live: reading job %s: %s", feed.row.id, exc)
                        data, read_ok = b"", False
                    if data:
                        buf.append(data)
                        grew = True
                        empty_delay[stream] = POLL[0]
                        continue
                    if final and read_ok:
                        buf.complete = True  # final and read to the end: no more will come
                        feed.wake()
                        continue
                    read_at[stream] = loop.time() + empty_delay[stream]
                    empty_delay[stream] = min(empty_delay[stream] * 2, POLL[1])
                if grew:
                    feed.wake()
                    store_delay = POLL[0]
                if all(buf.complete for buf in feed.streams.values()):
                    feed.finish(feed.row)
                    return
                if not grew:
                    # Until a follower moves, a stream's next poll, or the store's.
                    now = loop.time()
                    until = min([load_at, *(t for t in read_at.values() if t > now)])
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(until):
                            await demand.wait()
                if loop.time() >= load_at:
                    store_delay = await self._reload(feed, store_delay)
                    load_at = loop.time() + store_delay
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("live: watcher of job %s failed", feed.row.id)
            feed.finish(feed.row)

    async def _reload(self, feed: Feed, delay: float) -> float:
        """The row from the store (the old one while it is down); the next delay: POLL's first
        after a change, else doubled up to its cap."""
        with contextlib.suppress(Exception):
            fresh = await self._load(feed.row.id)
            if fresh is not None and fresh.state != feed.row.state:
                feed.update(fresh)
                return POLL[0]
            if fresh is not None:
                feed.row = fresh
        return min(delay * 2, POLL[1])

    async def close(self) -> None:
        tasks = [*self._watchers.values(), *self._publishers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchers.clear()
        if self.relay is not None:
            await self.relay.close()


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


def _stored(row: JobRow) -> Feed:
    """A finished command's feed: its kept output, final."""
    feed = Feed(row, 0)
    for stream in STREAMS:
        feed.streams[stream] = head_of(row, stream)
    feed.finish(row)
    return feed


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
