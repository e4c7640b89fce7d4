"""The hub: the feeds of this process, for the commands it runs and for the jobs it follows but
does not run (a watcher per job: the store's state, a batch job's files read ahead of its
followers, or another replica's command through the relay), and the admission of followers.

Tasks: the relay's listener is a task of the process's supervisor (api/tasks.py), started by
`start`; the watchers (`live-<id>`) and publishers (`pub-<id>`) are the hub's `TaskSet`,
cancelled and awaited by `close`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from api.live.feeds import READ_AHEAD, STREAMS, Feed, head_of, stored
from api.output import Stream
from api.problems import Problem, retry_after
from api.quota import Identity, Quota
from api.states import FINAL
from api.store import JobRow, new_id
from api.tasks import Child, OnDeath, Supervisor, TaskSet

log = logging.getLogger("sshapi.live")

POLL = (0.25, 2.0)  # watcher intervals: while output flows, and the idle cap (doubling)
MAX_PER_JOB = 64  # followers of one job in one process
# A live follower counts against its owner's follower cap for at most this long (a replica that
# dies with followers cannot block their owner for longer).
FOLLOWER_TTL = 3600.0

# The store's row of a job (None: gone).
Load = Callable[[str], Awaitable[JobRow | None]]
# A byte range of a batch job's output file, over SSH.
ReadFile = Callable[[JobRow, Stream, int, int], Awaitable[bytes]]


class Relay(Protocol):
    """Commands' live output between replicas (api/live/relay.py's RedisRelay)."""

    async def listen(self, wanted: Callable[[str], None]) -> None:
        """Call `wanted(job_id)` whenever another replica wants to follow a job; runs until
        cancelled (a failure of the relay's is retried inside)."""

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
        read_file: ReadFile,
        quota: Quota,
        max_followers: int,
        relay: Relay | None = None,
    ) -> None:
        self._load = load  # the store's row
        self._read_file = read_file
        self.quota = quota
        self.max_followers = max_followers  # per identity, over all replicas (the quota's)
        self.relay = relay
        self.feeds: dict[str, Feed] = {}
        self._tasks = TaskSet("live")
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._commands: set[str] = set()  # jobs whose feed this process fills from the pool
        self._publishers: dict[str, asyncio.Task[None]] = {}
        self._supervisor: Supervisor | None = None
        self._listener: Child | None = None
        self.followers = 0  # followers in this process, of any feed (finished jobs' too)

    def stats(self) -> dict[str, int]:
        """For /metrics: followers, feeds of commands run here, watchers of jobs run
        elsewhere (or batch jobs), publishers of our commands to other replicas."""
        return {
            "followers": self.followers,
            "commands": len(self._commands),
            "watchers": len(self._watchers),
            "publishers": len(self._publishers),
        }

    def start(self, tasks: Supervisor) -> None:
        """With a relay: listen, under `tasks`, for other replicas' interest in our commands."""
        if self.relay is not None:
            self._supervisor = tasks
            listen = functools.partial(self.relay.listen, self._wanted)
            self._listener = tasks.spawn("live-relay-listen", listen, OnDeath.RESTART)

    # ---- commands run here

    def open_command(self, row: JobRow, cap: int) -> Feed:
        feed = Feed(row, cap)
        self.feeds[row.id] = feed
        self._commands.add(row.id)
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
        task = self._tasks.spawn(self.relay.publish(self.feeds[job_id]), f"pub-{job_id}")
        self._publishers[job_id] = task
        task.add_done_callback(lambda _: self._publishers.pop(job_id, None))

    def wake_all(self) -> None:
        """Wake every follower of this process, to ask its `stop` again (a revocation came)."""
        for feed in list(self.feeds.values()):
            feed.wake()

    # ---- following

    @contextlib.asynccontextmanager
    async def following(self, who: Identity, row: JobRow) -> AsyncIterator[Feed]:
        """The live feed of a job, for one follower whose identity is `who` (a caller already
        allowed to see the job): counted against that identity's follower cap (like the
        active-job cap: shared through Redis when configured) for as long as it follows."""
        cap = self.max_followers
        follower = new_id()
        try:
            await self.quota.enter(who, follower, cap, FOLLOWER_TTL, space="followers")
        except Problem as exc:
            raise Problem(
                429,
                "too-many-followers",
                "Too many followers",
                f"at most {cap} live followers at once per identity",
                headers=exc.headers,
            ) from None
        try:
            async with self.feed_for(row) as feed:
                yield feed
        finally:
            await self.quota.leave(who, follower, space="followers")

    @contextlib.asynccontextmanager
    async def feed_for(self, row: JobRow) -> AsyncIterator[Feed]:
        """The feed of `row` for one follower, counted while it follows; the watcher of a job
        this process does not run stops once its last follower leaves."""
        feed = self.feeds.get(row.id)
        if feed is None:
            feed = stored(row) if row.state in FINAL and row.kind != "batch" else self._watch(row)
        if feed.followers >= MAX_PER_JOB:
            raise Problem(
                429,
                "too-many-followers",
                "Too many followers of this job",
                f"at most {MAX_PER_JOB} followers of one job",
                headers=retry_after(5),
            )
        feed.followers += 1
        self.followers += 1
        try:
            yield feed
        finally:
            self.followers -= 1
            feed.followers -= 1
            if feed.followers == 0 and row.id in self._watchers:
                self._watchers.pop(row.id).cancel()
                if self.feeds.get(row.id) is feed:
                    del self.feeds[row.id]

    def _watch(self, row: JobRow) -> Feed:
        if row.kind == "batch":

            async def refill(stream: Stream, offset: int, limit: int) -> bytes:
                return await self._read_file(feed.row, stream, offset, limit)

            feed = Feed(row, 0, refill, window=READ_AHEAD)
            watcher = self._read_ahead(feed)
        else:
            feed = Feed(row, 0)
            watcher = self._watcher(feed)
        self.feeds[row.id] = feed
        self._watchers[row.id] = self._tasks.spawn(watcher, f"live-{row.id}")
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
                        data = await self._read_file(
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
        """The listener stopped, the watchers and publishers cancelled and awaited, the relay
        closed."""
        if self._supervisor is not None and self._listener is not None:
            await self._supervisor.stop(self._listener)
            self._listener = None
        await self._tasks.close()
        self._watchers.clear()
        self._publishers.clear()
        if self.relay is not None:
            await self.relay.close()
