"""Redis pub/sub between the replicas (SSHAPI_REDIS_URL): the one listener loop every nudge
channel uses (revocations, api/admin/revocations.py; live output's interest,
api/live/relay.py; the sshd budget's nudges, api/sshd_budget.py; login nodes' health,
api/node_health.py). Pub/sub delivers only to whoever listens at that instant, so each use
keeps a way to do without it (a poll, a renewal); the loop only has to come back after a
failure, paced."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from api.quota import REDIS_TIMEOUT

# After a failure of Redis's the listener subscribes again this long after (unless its caller
# says otherwise), doubling to MAX_RETRY seconds, and from the first pause again once
# subscribed.
FIRST_RETRY = 0.25
MAX_RETRY = 10.0


def subscriber(url: str) -> Any:
    """A client for listening: a long-lived connection with health checks and no socket timeout
    (it waits for messages as long as there are none)."""
    import redis.asyncio as aioredis

    return aioredis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT, health_check_interval=30)


async def listen(
    client: Any,
    channel: str,
    on_message: Callable[[bytes], None],
    on_failure: Callable[[Exception], None],
    on_subscribed: Callable[[], None] | None = None,
    first_retry: float = FIRST_RETRY,
) -> None:
    """Call `on_message(data)` for every message on `channel`, and `on_subscribed()` after each
    (re)subscription, until cancelled. A failure of Redis's goes to `on_failure` and is retried
    here, paced (`first_retry` doubling to MAX_RETRY)."""
    delay = first_retry
    while True:
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                delay = first_retry
                if on_subscribed is not None:
                    on_subscribed()
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        on_message(bytes(message["data"]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            on_failure(exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, MAX_RETRY)
