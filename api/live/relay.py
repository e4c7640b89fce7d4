"""Live output across replicas, through Redis (SSHAPI_REDIS_URL): a command's bytes live in the
memory of the replica that runs it (the owner); a follower on another replica gets them from a
capped Redis stream per job and output stream.

    owner: Feed --cursor--> publisher --XADD--> sshapi:live:<job>:stdout|stderr|state
    other replica: watcher --XREAD BLOCK--> its own Feed --> its followers (api/live/)

Why Redis *streams*, not pub/sub: a stream keeps the latest bytes, so a follower that arrives
late, or a watcher that reconnects, reads them again by offset; pub/sub delivers only to whoever
listens at that instant. Each entry's id is `<byte offset>-1`, so the stream is trimmed by
bytes, not entries (`XADD MINID ~ <offset - WINDOW>`: the same 256 KiB-and-a-bit window as the
owner's), and a watcher resumes after the last id it read. The keys expire `EXPIRE` seconds after
their last write, a minute after the job ends.

Publishing costs nothing per job unless someone follows remotely: a watcher announces the job on
the owner's channel (`sshapi:live:want:<replica>`, pub/sub, repeated every `ANNOUNCE` s while it
watches) and only then does the owner start its publisher, from byte 0 of what it keeps (the
head, then the window). The publisher is a cursor into the owner's Feed like any follower, so
it never slows the command: when it (or Redis) falls behind, its cursor skips to the window and
the watcher sees the bytes missing; its followers get a `cutoff`, then a `gap` on resume, and the
kept head stays readable through `/output`.

Redis down or unreachable: publishing drops its bytes (logged once), and a watcher falls back to
polling the shared store (api/live/hub.py): state changes within 2 s, the kept output once the job
is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from api.live.feeds import READ, STREAMS, WINDOW, Feed, StreamBuffer, head_of, kept
from api.live.hub import POLL
from api.output import Stream
from api.pubsub import listen, subscriber
from api.quota import PREFIX, REDIS_TIMEOUT
from api.states import FINAL
from api.store import JobRow

log = logging.getLogger("sshapi.relay")

BLOCK = 1.0  # seconds one XREAD waits for new entries
ANNOUNCE = 5.0  # a watcher repeats its interest this often (the owner may have missed it)
EXPIRE = 600  # seconds the keys of a job live after their last write
EXPIRE_FINAL = 60  # ... after the job ended: late followers read the store
PER_ROUND = 4  # entries per stream per publisher round, so that state and the other stream go on
MAX_WATCHERS = 256  # blocking Redis connections for watchers in one process (then: polling)

Load = Callable[[str], Awaitable[JobRow | None]]
# The keys of one job, in the order a watcher reads them: the state (it may carry the head's
# cap), the heads, then the windows (a head's bytes always come before its window's).
PARTS = ("state", "stdout-head", "stderr-head", "stdout", "stderr")


def key(job_id: str, part: str) -> str:
    return f"{PREFIX}live:{job_id}:{part}"


def want_channel(replica: str) -> str:
    return f"{PREFIX}live:want:{replica}"


def put(buf: StreamBuffer, offset: int, data: bytes) -> None:
    """Add the bytes at `offset` to a watcher's buffer: skip what it already has, and the bytes
    it never got (a jump) are lost to it."""
    if offset > buf.total:
        buf.skip_to(offset)
    elif offset < buf.total:
        data = data[buf.total - offset :]
    if data:
        buf.append(data)


def settle(feed: Feed, row: JobRow, relayed: set[Stream]) -> None:
    """The job is final: complete each stream with what the job kept (its head), so that the
    followers end where the job's byte counts do."""
    for stream in STREAMS:
        if stream not in relayed:  # nothing came through Redis: the kept output, as without it
            feed.streams[stream] = head_of(row, stream)
            continue
        buf = feed.streams[stream]
        head = kept(row, stream)
        total = row.stdout_bytes if stream == "stdout" else row.stderr_bytes
        if buf.total < len(head):
            buf.append(head[buf.total :])
        if buf.total < (total or 0):
            buf.skip_to(total)


def _bytes_entry(feed: Feed, part: str, entry_id: bytes, fields: dict[bytes, bytes]) -> Stream:
    """Put one entry of a head or window key into the feed; its stream."""
    stream: Stream = "stdout" if part.startswith("stdout") else "stderr"
    offset = int(bytes(entry_id).split(b"-", 1)[0])
    put(feed.streams[stream], offset, bytes(fields[b"d"]))
    return stream


class RedisRelay:
    """One per process: publishes the commands it runs that others follow, and watches the
    commands other replicas run for its followers."""

    def __init__(self, url: str, replica: str) -> None:
        import redis.asyncio as aioredis

        self.replica = replica
        # Writes: bounded like the quota's calls. Blocking reads: their own pool, and no socket
        # timeout shorter than the block. Pub/sub: a long-lived connection with health checks.
        self._redis: Any = aioredis.from_url(
            url, socket_timeout=1.0, socket_connect_timeout=REDIS_TIMEOUT
        )
        self._reader: Any = aioredis.from_url(
            url,
            socket_timeout=BLOCK + 2.0,
            socket_connect_timeout=REDIS_TIMEOUT,
            max_connections=MAX_WATCHERS,
        )
        self._sub = subscriber(url)
        self._failing = False

    def _failed(self, what: str, exc: Exception) -> None:
        if not self._failing:
            self._failing = True
            log.warning(
                "live relay: Redis %s failed (%s): remote followers poll the store", what, exc
            )

    def _ok(self) -> None:
        if self._failing:
            self._failing = False
            log.warning("live relay: Redis is back")

    # ---- the owner

    async def listen(self, wanted: Callable[[str], None]) -> None:
        """Listen for other replicas' interest in the jobs this one runs, until cancelled: a
        failure of Redis's is retried (api/pubsub.py)."""
        await listen(
            self._sub,
            want_channel(self.replica),
            lambda data: wanted(data.decode("ascii", "replace")[:64]),
            lambda exc: self._failed("subscribe", exc),
        )

    async def publish(self, feed: Feed) -> None:
        """Copy `feed` (a command this replica runs) to its Redis streams until it is final."""
        job_id = feed.row.id
        offsets = {s: 0 for s in STREAMS}
        sent_state: str | None = None
        cap = feed.streams["stdout"].cap
        while True:
            waiter = feed.waiter()
            final = feed.final  # read before the bytes: a final feed gets no more of them
            pipe = self._redis.pipeline(transaction=False)
            written: set[str] = set()
            state = feed.row.state
            if state != sent_state and state not in FINAL:
                pipe.xadd(key(job_id, "state"), {"state": state, "cap": cap}, maxlen=16)
                written.add("state")
                sent_state = state
            more = False
            for stream in STREAMS:
                buf, offset = feed.streams[stream], offsets[stream]
                for _ in range(PER_ROUND):
                    data = buf.read(offset, READ)
                    if data is None:  # fell out of the window: the watcher sees a jump
                        offset = buf.tail_start
                        data = buf.read(offset, READ) or b""
                    if not data:
                        break
                    # The head (the first `cap` bytes) goes to a key of its own, never trimmed
                    # (at most max_output): a late watcher gets it as a local follower would.
                    cut = max(0, min(len(data), cap - offset))
                    for part, at, piece in (
                        (f"{stream}-head", offset, data[:cut]),
                        (stream, offset + cut, data[cut:]),
                    ):
                        if piece:
                            trim = {} if part != stream else {"minid": max(0, at - WINDOW)}
                            pipe.xadd(key(job_id, part), {"d": piece}, id=f"{at}-1", **trim)
                            written.add(part)
                    offset += len(data)
                else:
                    more = more or buf.total > offset
                offsets[stream] = offset
            done = final and not more and state in FINAL
            if done and state != sent_state:  # the last entry: every byte is before it
                pipe.xadd(key(job_id, "state"), {"state": state, "cap": cap}, maxlen=16)
                written.add("state")
            for part in written if not done else PARTS:
                pipe.expire(key(job_id, part), EXPIRE_FINAL if done else EXPIRE)
            if written or done:
                try:
                    await pipe.execute()
                    self._ok()
                except Exception as exc:  # those bytes are lost to remote followers
                    self._failed("publish", exc)
            if done:
                return
            if not written:
                await waiter.wait()

    # ---- the other replicas

    async def watch(self, feed: Feed, load: Load) -> None:
        """Feed `feed` (another replica's command) from Redis until the job is final. Without
        Redis the store is polled (state only, and the kept output at the end)."""
        job_id = feed.row.id
        parts = {key(job_id, p).encode(): p for p in PARTS}
        last: dict[bytes, bytes | str] = dict.fromkeys(parts, "0")
        relayed: set[Stream] = set()
        loop = asyncio.get_running_loop()
        announce_at = poll_at = 0.0
        delay = POLL[0]
        while True:
            now = loop.time()
            if now >= announce_at:
                with contextlib.suppress(Exception):  # Redis down: the reads below fail too
                    await self._redis.publish(want_channel(feed.row.replica), job_id)
                announce_at = now + ANNOUNCE
            final_seen = False
            try:
                reply = await self._reader.xread(last, block=int(BLOCK * 1000))
                self._ok()
                delay = POLL[0]
            except Exception as exc:
                self._failed("read", exc)
                reply = []
                await asyncio.sleep(delay)
                delay = min(delay * 2, POLL[1])
            grew = False
            for name, entries in reply or []:
                part = parts[bytes(name)]
                for entry_id, fields in entries:
                    last[bytes(name)] = entry_id
                    if part == "state":
                        final_seen |= await self._state(feed, load, fields)
                    else:
                        relayed.add(_bytes_entry(feed, part, entry_id, fields))
                        grew = True
            if grew:
                feed.wake()
            if not final_seen and loop.time() < poll_at:
                continue
            poll_at = loop.time() + POLL[1]
            fresh = None
            with contextlib.suppress(Exception):  # the store is down: the old row meanwhile
                fresh = await load(job_id)
            if fresh is None:
                continue
            if fresh.state not in FINAL:
                if fresh.state != feed.row.state:
                    feed.update(fresh)
                continue
            if not final_seen:  # final by the store: what Redis still holds, then the end
                with contextlib.suppress(Exception):
                    for name, entries in await self._reader.xread(last) or []:
                        part = parts[bytes(name)]
                        for entry_id, fields in entries if part != "state" else []:
                            relayed.add(_bytes_entry(feed, part, entry_id, fields))
            settle(feed, fresh, relayed)
            feed.finish(fresh)
            return

    async def _state(self, feed: Feed, load: Load, fields: dict[bytes, bytes]) -> bool:
        """A state entry: the row from the store (the owner may not have written it yet: then
        the row we have, in the new state). True when final (handled by the caller)."""
        state = bytes(fields.get(b"state", b"")).decode("ascii", "replace")
        with contextlib.suppress(ValueError):
            cap = int(fields.get(b"cap", b"0"))
            for buf in feed.streams.values():
                if buf.total == 0 and buf.cap < cap:  # the owner keeps this head: so do we
                    buf.cap = cap
        if state in FINAL:
            return True
        if state != feed.row.state:
            fresh = None
            with contextlib.suppress(Exception):
                fresh = await load(feed.row.id)
            row = fresh if fresh is not None and fresh.state not in FINAL else feed.row
            row.state = state
            feed.update(row)
        return False

    async def close(self) -> None:
        """Close the Redis clients (the listener, the hub's, is stopped before)."""
        for client in (self._redis, self._reader, self._sub):
            with contextlib.suppress(Exception):
                await client.aclose()


def make_relay(redis_url: str | None, replica: str) -> RedisRelay | None:
    return RedisRelay(redis_url, replica) if redis_url else None
