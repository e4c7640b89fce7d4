"""The change feed: one stream per identity of its jobs' state changes
(`GET /v1/jobs/events`, docs/portals.md), so that a portal with a thousand running jobs holds
one connection instead of polling each.

The events are the store's (api/store/portals.py): written in the transaction that changes the
state, numbered by a durable `seq` in commit order, which is the SSE id a client resumes from
(`Last-Event-ID`), on any replica. Waking is this module's: the store tells `changed` whose job
changed once the transaction committed; the followers of that identity in this process read the
log again, and with Redis (SSHAPI_REDIS_URL) the owner is published on CHANNEL so that the other
replicas' followers do too (api/pubsub.py). Pub/sub is best effort, so every feed also reads the
log at its keep-alive (`[api] change_keepalive`), and every POLL seconds when other processes
share the store and Redis is absent or failing.

Bounded: `max_change_feeds` feeds per identity (the quota's capped set: over all replicas with
Redis), a page of PAGE events per read, events kept `change_window` seconds (pruned by every
replica every PRUNE_EVERY seconds; an older Last-Event-ID gets a `reset` event)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

from api.problems import Problem, retry_after
from api.pubsub import listen, subscriber
from api.quota import PREFIX, REDIS_TIMEOUT, Identity, Quota
from api.store import JobEvent, Store, new_id, utcnow

log = logging.getLogger("sshapi.changes")

CHANNEL = f"{PREFIX}changes"
PAGE = 500  # events per read of the log
POLL = 1.0  # seconds between reads when other processes' changes come without a nudge
PRUNE_EVERY = 600.0
FEED_TTL = 3600.0  # a feed's place in the cap lapses after this unless renewed (a dead replica)
RENEW = 600.0

Owner = tuple[str, str]


class ChangeFeeds:
    """The change feeds of this process, and the nudges between replicas."""

    def __init__(
        self,
        store: Store,
        quota: Quota,
        *,
        cap: int,
        keepalive: float,
        window: float,
        replica: str,
        shared: bool,
        redis_url: str | None = None,
    ) -> None:
        """`shared`: other processes write to the store too (replicas, workers)."""
        self.store = store
        self.quota = quota
        self.cap = cap
        self.keepalive = keepalive
        self.window = window
        self.replica = replica
        self.shared = shared
        self._waiters: dict[Owner, set[asyncio.Event]] = {}
        self._pending: set[Owner | None] = set()
        self._kick = asyncio.Event()
        self._redis: Any = None
        self._sub: Any = None
        self._heard = False  # subscribed to CHANNEL now
        self._failing = False
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(
                redis_url, socket_timeout=1.0, socket_connect_timeout=REDIS_TIMEOUT
            )
            self._sub = subscriber(redis_url)

    # ---- waking

    def changed(self, owner: Owner | None) -> None:
        """The store committed a state change of `owner`'s job (None: of anyone's)."""
        self._wake(owner)
        if self._redis is not None:
            self._pending.add(owner)
            self._kick.set()

    def _wake(self, owner: Owner | None) -> None:
        if owner is None:
            self.wake_all()
            return
        for event in self._waiters.get(owner, ()):
            event.set()

    def wake_all(self) -> None:
        """Every feed reads again (and asks its `stop`: a revocation came)."""
        for events in self._waiters.values():
            for event in events:
                event.set()

    @property
    def poll(self) -> float:
        """How long a feed waits for a nudge before reading the log anyway."""
        if self.shared and not self._heard:
            return POLL
        return self.keepalive

    # ---- the tasks (the supervisor's)

    async def publish_loop(self) -> None:
        """Publish the owners whose jobs changed here, coalesced, for the other replicas."""
        while True:
            await self._kick.wait()
            self._kick.clear()
            owners, self._pending = self._pending, set()
            for owner in owners:
                message = json.dumps([self.replica, owner])
                try:
                    await self._redis.publish(CHANNEL, message)
                except Exception as exc:
                    self._failed("publish", exc)

    async def listen_loop(self) -> None:
        def heard(data: bytes) -> None:
            try:
                replica, owner = json.loads(data)
                if replica != self.replica:
                    self._wake(tuple(owner) if isinstance(owner, list) else None)
            except (ValueError, TypeError):
                return

        def subscribed() -> None:
            self._heard, self._failing = True, False
            self.wake_all()  # what was published while we were away

        def failed(exc: Exception) -> None:
            self._heard = False
            self._failed("subscribe", exc)

        await listen(self._sub, CHANNEL, heard, failed, subscribed)

    def _failed(self, what: str, exc: Exception) -> None:
        if not self._failing:
            self._failing = True
            log.warning("change feed: Redis %s failed (%s): feeds poll the store", what, exc)

    async def prune_loop(self) -> None:
        while True:
            try:
                await self.store.prune_events(utcnow() - timedelta(seconds=self.window))
            except Exception as exc:
                log.warning("pruning the job events failed: %s", type(exc).__name__)
            await asyncio.sleep(PRUNE_EVERY)

    def loops(self) -> dict[str, Callable[[], Any]]:
        loops: dict[str, Callable[[], Any]] = {"change-prune": self.prune_loop}
        if self._redis is not None:
            loops |= {"change-publish": self.publish_loop, "change-listen": self.listen_loop}
        return loops

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            await self._sub.aclose()

    # ---- one feed

    async def bounds(self) -> tuple[int, int] | None:
        """The lowest and highest event id kept (None: none is)."""
        return await self.store.event_bounds()

    @contextlib.asynccontextmanager
    async def admitted(self, who: Identity) -> AsyncIterator[str]:
        """A place among `who`'s feeds for as long as the feed runs; 429 beyond the cap."""
        feed_id = new_id()
        try:
            await self.quota.enter(who, feed_id, self.cap, FEED_TTL, space="changes")
        except Problem as exc:
            if exc.status != 429:
                raise
            raise Problem(429, "too-many-feeds", "Too many change feeds",
                          f"at most {self.cap} change feeds at once per identity",
                          headers=retry_after(5)) from None  # fmt: skip
        try:
            yield feed_id
        finally:
            await self.quota.leave(who, feed_id, space="changes")

    async def events(
        self, owner: Owner, after: int, stop: Callable[[], bool], feed_id: str
    ) -> AsyncIterator[list[JobEvent] | None]:
        """`owner`'s events after seq `after`, a page at a time as they come; None when the
        keep-alive is due. Ends when `stop()` says so (a revocation)."""
        wake = asyncio.Event()
        self._waiters.setdefault(owner, set()).add(wake)
        idle_since = renewed = time.monotonic()
        try:
            while not stop():
                wake.clear()  # before the read: a change committed during it wakes the next
                try:
                    page = await self.store.events_after(owner, after, PAGE)
                except Exception as exc:  # the store is away: the next round reads again
                    log.warning("reading the job events failed: %s", type(exc).__name__)
                    page = []
                if page:
                    after = page[-1].seq
                    idle_since = time.monotonic()
                    yield page
                    if len(page) == PAGE:
                        continue
                now = time.monotonic()
                if now - idle_since >= self.keepalive:
                    idle_since = now
                    yield None
                if now - renewed >= RENEW:
                    renewed = now
                    await self.quota.hold(owner, feed_id, FEED_TTL, space="changes")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self.poll, self.keepalive)):
                        await wake.wait()
        finally:
            waiters = self._waiters.get(owner)
            if waiters is not None:
                waiters.discard(wake)
                if not waiters:
                    del self._waiters[owner]
