"""Per-identity admission limits: a token bucket (jobs per second, with a burst) and a cap on
active (queued + running) jobs. Two implementations of one interface:

- `LocalQuota` (the default): in this process. N replicas allow N times the rate and the cap.
- `RedisQuota` (SSHAPI_REDIS_URL): shared by every replica, each check one atomic Lua script.
  Time comes from Redis (`TIME`), so replicas' clocks do not matter.

Active jobs are kept in Redis as a sorted set per identity: member = job id, score = the latest
time the job can still be active (created + queue timeout + command timeout + a margin). A
replica that dies without releasing its jobs therefore cannot block their owner for longer than
those jobs could have run anyway; no heartbeat, no cleanup task.

Batch jobs count until they are final, however long they pend (api/jobs/batch.py): their entry's
expiry is their time limit plus a margin from the last `hold`, which the process tracking them
renews periodically. A tracking process that is gone stops renewing, and the entry lapses within
the job's time limit plus that margin.

Redis down or slow (every call is bounded by REDIS_TIMEOUT): we fail *open to the local limits*,
not closed. The limits protect fairness between users, not the hosts (the pool's own caps and
queue do that), and failing closed would turn a Redis outage into an outage of the whole API.
While Redis is unreachable each replica enforces the limits on its own, so the worst case is the
single-process behaviour: N replicas allow N times the rate.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal, Protocol

from api.problems import Problem, retry_after

log = logging.getLogger("sshapi.quota")

Identity = tuple[str, str]  # api/auth.py `Principal.key`: (issuer, subject)
REDIS_TIMEOUT = 0.25  # seconds per Redis call before falling back to the local limits
PREFIX = "sshapi:"


# The capped sets an identity has places in: active jobs (batch jobs, checksums: anything that
# takes a place under `max_concurrent`), transfers, directory listings, live followers; and
# `commits`, one upload's commit per (host, path). The values are what each set's Redis key
# holds between the kind and the identity: the key format of the previous releases, kept as it
# was so that replicas of the old and the new release share the caps through a rolling restart.
Space = Literal["jobs", "transfers", "listings", "followers", "commits", "changes"]
SPACES: dict[Space, str] = {
    "jobs": "",
    "transfers": "files\0",
    "listings": "listings\0",
    "followers": "follow:",
    "commits": "files-commit\0",
    "changes": "changes\0",
}

# The buckets of one identity: job submissions, and SSH-backed reads (output reads, cancels).
Bucket = Literal["rate", "reads"]
WHAT = {"rate": "jobs", "reads": "output reads and cancels"}


def rate_limited(rate: float, burst: int, wait: float, bucket: Bucket = "rate") -> Problem:
    return Problem(
        429,
        "rate-limited",
        "Too many requests",
        f"at most {rate:g} {WHAT[bucket]}/s (burst {burst}); retry in {wait:.1f} s",
        headers=retry_after(wait),
    )


def too_many_jobs(cap: int) -> Problem:
    return Problem(
        429,
        "too-many-jobs",
        "Too many active jobs",
        f"at most {cap} jobs at once",
        headers=retry_after(1),
    )


class Quota(Protocol):
    async def take(self, who: Identity, rate: float, burst: int, bucket: Bucket = "rate") -> None:
        """Spend one token of who's bucket or raise 429 `rate-limited` with Retry-After."""

    async def enter(
        self, who: Identity, job_id: str, cap: int, ttl: float, space: Space = "jobs"
    ) -> None:
        """Count job_id as active for who (at most `ttl` seconds) or raise 429 `too-many-jobs`."""

    async def hold(self, who: Identity, job_id: str, ttl: float, space: Space = "jobs") -> None:
        """Count job_id (already admitted) as active for `ttl` more seconds, whatever the cap:
        a batch job's entry renewed by the process tracking it."""

    async def leave(self, who: Identity, job_id: str, space: Space = "jobs") -> None:
        """The job is no longer active."""

    async def ping(self) -> bool | None:
        """Does Redis answer now (None: no Redis)? For /metrics' sshapi_redis_up."""

    async def close(self) -> None: ...


class LocalQuota:
    """Token buckets and active-job sets in this process."""

    MAX_BUCKETS = 100_000

    def __init__(self) -> None:
        # (bucket, identity) -> (tokens, last refill time)
        self._buckets: dict[tuple[Bucket, Identity], tuple[float, float]] = {}
        self._active: dict[tuple[Space, Identity], set[str]] = {}

    async def take(self, who: Identity, rate: float, burst: int, bucket: Bucket = "rate") -> None:
        now = time.monotonic()
        key = (bucket, who)
        tokens, last = self._buckets.get(key, (float(burst), now))
        tokens = min(float(burst), tokens + (now - last) * rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            raise rate_limited(rate, burst, (1.0 - tokens) / rate, bucket)
        self._buckets[key] = (tokens - 1.0, now)
        if len(self._buckets) > self.MAX_BUCKETS:
            # A bucket idle for an hour is (nearly always) full again: forgetting it costs nothing.
            for k in [k for k, (_, t) in self._buckets.items() if now - t > 3600]:
                del self._buckets[k]

    async def enter(
        self, who: Identity, job_id: str, cap: int, ttl: float, space: Space = "jobs"
    ) -> None:
        jobs = self._active.setdefault((space, who), set())
        if len(jobs) >= cap:
            raise too_many_jobs(cap)
        jobs.add(job_id)

    async def hold(self, who: Identity, job_id: str, ttl: float, space: Space = "jobs") -> None:
        self._active.setdefault((space, who), set()).add(job_id)

    async def leave(self, who: Identity, job_id: str, space: Space = "jobs") -> None:
        jobs = self._active.get((space, who))
        if jobs is not None:
            jobs.discard(job_id)
            if not jobs:
                del self._active[(space, who)]

    async def ping(self) -> bool | None:
        return None

    async def close(self) -> None:
        pass


# KEYS[1] bucket hash; ARGV rate, burst. Returns {allowed, seconds to wait (string)}.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(b[1]) or burst, tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local ok = 0
if tokens >= 1 then tokens = tokens - 1; ok = 1 end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return {ok, tostring((1 - tokens) / rate)}
"""

# KEYS[1] active-job sorted set; ARGV job id, cap, ttl. Returns 1 if admitted.
ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
local until_ = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], until_, ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(last[2])) + 1)
return 1
"""


# KEYS[1] active-job sorted set; ARGV job id, ttl. Adds or renews the entry, no cap check.
HOLD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(last[2])) + 1)
return 1
"""


class RedisQuota:
    """The limits shared by every replica through Redis; the local limits while it is down."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.from_url(
            url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT
        )
        self._take = self._redis.register_script(TAKE)
        self._enter = self._redis.register_script(ENTER)
        self._hold = self._redis.register_script(HOLD)
        self.fallback = LocalQuota()
        self._down_since: float | None = None

    def _failed(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "Redis unreachable (%s): enforcing limits per replica until it is back", exc
            )

    def _ok(self) -> None:
        if self._down_since is not None:
            self._down_since = None
            log.warning("Redis is back: limits are shared by all replicas again")

    @staticmethod
    def _key(kind: str, who: Identity, space: Space | None = None) -> str:
        # A NUL separates issuer and subject: neither holds one in practice, so keys never clash.
        within = SPACES[space] if space is not None else ""
        return f"{PREFIX}{kind}:{within}{who[0]}\0{who[1]}"

    async def take(self, who: Identity, rate: float, burst: int, bucket: Bucket = "rate") -> None:
        try:
            ok, wait = await self._take(keys=[self._key(bucket, who)], args=[rate, burst])
        except Exception as exc:  # any Redis or network failure: the local limits apply
            self._failed(exc)
            return await self.fallback.take(who, rate, burst, bucket)
        self._ok()
        if not ok:
            raise rate_limited(rate, burst, float(wait), bucket)

    async def enter(
        self, who: Identity, job_id: str, cap: int, ttl: float, space: Space = "jobs"
    ) -> None:
        try:
            key = self._key("active", who, space)
            ok = await self._enter(keys=[key], args=[job_id, cap, ttl])
        except Exception as exc:
            self._failed(exc)
            return await self.fallback.enter(who, job_id, cap, ttl, space)
        self._ok()
        if not ok:
            raise too_many_jobs(cap)

    async def hold(self, who: Identity, job_id: str, ttl: float, space: Space = "jobs") -> None:
        try:
            await self._hold(keys=[self._key("active", who, space)], args=[job_id, ttl])
        except Exception as exc:
            self._failed(exc)
            return await self.fallback.hold(who, job_id, ttl, space)
        self._ok()

    async def leave(self, who: Identity, job_id: str, space: Space = "jobs") -> None:
        # The job may have been counted by either side (Redis went down or came back meanwhile).
        await self.fallback.leave(who, job_id, space)
        try:
            await self._redis.zrem(self._key("active", who, space), job_id)
        except Exception as exc:
            self._failed(exc)  # the entry expires at its deadline by itself

    async def ping(self) -> bool | None:
        """One PING within REDIS_TIMEOUT; a failure or a recovery is logged as a call's is."""
        try:
            await self._redis.ping()
        except Exception as exc:
            self._failed(exc)
            return False
        self._ok()
        return True

    async def close(self) -> None:
        await self._redis.aclose()


def make_quota(redis_url: str | None) -> Quota:
    return RedisQuota(redis_url) if redis_url else LocalQuota()
