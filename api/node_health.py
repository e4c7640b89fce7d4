"""Login nodes' health shared by every process of every replica through Redis (docs/pool.md,
"Many processes, one sshd"): the Redis side of `sshpool.NodeHealth`.

A process whose probe takes a node down sets the node's key (`node:<host>:<port>`: who, why, a
token for this verdict) with a time to live of `TTL`, renewed each `RENEW` while it still
holds the node down, and publishes it on the channel; the others take the node out of their
routing at once (`Router.heard`) and probe it themselves. A process whose probe brings a node
back deletes the key and publishes that; the others probe the node now, and take it back only
when their own probe answers. The keys are read each `RENEW` too, so that a process that
missed a message (it started later, its subscription was lost) still learns of a node down.

Redis lost: verdicts are not shared meanwhile (each process judges its nodes alone, as with
no Redis), and are never replayed: a verdict is about the node as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
from collections import deque
from typing import Any

from api.pubsub import listen, subscriber
from api.quota import PREFIX, REDIS_TIMEOUT
from sshpool import Router

log = logging.getLogger("sshapi.node_health")

TTL = 10.0  # seconds a node's down key outlives the last renewal of the process that set it
RENEW = 1.0  # how often the keys are renewed and read
RETRY = 0.5  # the first pause before the subscription is tried again (doubling, to 10 s)
OUTBOX = 256  # verdicts kept while Redis is slow; older ones are dropped (stale anyway)


class RedisNodeHealth:
    """One per pool; `loop` and `listen` are the supervisor's tasks (api/services.py)."""

    def __init__(self, url: str, name: str, prefix: str = PREFIX, ttl: float = TTL) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.from_url(
            url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT
        )
        self._sub: Any = subscriber(url)
        self.ttl = ttl
        self.prefix = f"{prefix}node:"
        self.channel = f"{prefix}node-health"
        self.me = f"{name}:{os.getpid()}:{secrets.token_hex(4)}"
        self.router: Router | None = None
        self._outbox: deque[dict[str, Any]] = deque(maxlen=OUTBOX)
        self._wake = asyncio.Event()
        # Nodes this process holds down (its own verdict) -> the key's value it set.
        self._mine: dict[str, str] = {}
        # Per node, the token of the last verdict applied here: each is applied once.
        self._seen: dict[str, str] = {}
        self._failing = False

    # ---- sshpool.NodeHealth (synchronous, no I/O) ----

    def attach(self, router: Router) -> None:
        self.router = router

    def publish(self, node: str, down: bool, why: str) -> None:
        token = secrets.token_hex(8)
        self._seen[node] = token
        self._outbox.append(
            {"node": node, "down": down, "why": why, "token": token, "from": self.me}
        )
        self._wake.set()

    # ---- the tasks ----

    async def loop(self) -> None:
        """Send this process's verdicts, renew its down keys and read the others', until
        cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RENEW):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.step()
            except Exception as exc:  # any Redis or network failure: each process alone
                self._outbox.clear()
                if not self._failing:
                    self._failing = True
                    log.warning("Redis unreachable (%s): login nodes' health is not shared", exc)
            else:
                if self._failing:
                    self._failing = False
                    log.warning("Redis is back: login nodes' health is shared again")

    async def step(self) -> None:
        while self._outbox:
            verdict = self._outbox[0]
            key = self.prefix + verdict["node"]
            value = json.dumps(verdict)
            if verdict["down"]:
                await self._redis.set(key, value, ex=int(self.ttl))
                self._mine[verdict["node"]] = value
            else:
                await self._redis.delete(key)
                self._mine.pop(verdict["node"], None)
            await self._redis.publish(self.channel, value)
            self._outbox.popleft()
        for node, value in list(self._mine.items()):
            # Renewed only while the key is still this verdict (another's probe may have
            # brought the node back meanwhile).
            if await self._redis.get(self.prefix + node) != value.encode():
                del self._mine[node]
            else:
                await self._redis.expire(self.prefix + node, int(self.ttl))
        if self.router is not None:
            nodes = sorted(self.router.watched())
            if nodes:
                values = await self._redis.mget([self.prefix + n for n in nodes])
                for value in values:
                    if value is not None:
                        self._heard(value)

    async def listen(self) -> None:
        """Apply the other processes' verdicts as they come, until cancelled; Redis's failures
        are retried (api/pubsub.py), from RETRY on, and not logged: the loop's own calls say
        so (and read the keys each RENEW anyway)."""
        await listen(self._sub, self.channel, self._heard, lambda _: None, first_retry=RETRY)

    def _heard(self, raw: bytes) -> None:
        """Another process's verdict (a message or a key), applied once; a malformed one is
        ignored (anyone reaching Redis could write it)."""
        try:
            verdict = json.loads(raw)
            node, down, why = verdict["node"], bool(verdict["down"]), str(verdict["why"])
            token, origin = verdict["token"], verdict["from"]
        except (ValueError, KeyError, TypeError):
            return
        if origin == self.me or self._seen.get(node) == token or self.router is None:
            return
        self._seen[node] = token
        self.router.heard(str(node), down, why[:200])

    async def close(self) -> None:
        for client in (self._redis, self._sub):
            with contextlib.suppress(Exception):  # a slow close must not fail the shutdown
                await client.aclose()
