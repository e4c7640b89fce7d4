"""Each sshd's handshake gate and connection budget shared by every process of every replica,
through Redis (docs/pool.md, "Many processes, one sshd"): the `sshpool.budget.Coordinator` the
API gives its pool.

Per sshd (its resolved address and port, as the pool keys it), Redis holds each live process's
lease of connection slots and of handshake slots, what it wants of each, and when its lease
lapses (a sorted set: process -> expiry, `TTL` seconds after its last call). One Lua script
(`LEASE`) does a process's whole step atomically: it forgets the processes whose lease lapsed
(a dead process's slots free within `TTL`), records this process's use and demand, and sets
its lease:

- the fair level is the max-min share of the total over the processes' demands (water
  filling); a process grows into free slots, up to what it wants, or up to the fair level
  (rounded up) while others want more than they hold;
- while others hold less than their fair level (rounded down) and the free slots do not cover
  it, a process above the level is told to come down to it: its share (`cap`) drops at once,
  the sshd closes its idle connections (least recently used first) and its busy ones yield;
  its lease follows as they close (a lease never drops below what the process holds);
- a lease above what a process wants is kept while no other process wants more (the next
  handshake or connection then needs no call), and given back (down to what it holds) when
  one does.

So at every moment the leases sum to at most the total, and each process holds at most its
lease. The refused-login penalty of the sshd (`Penalties`) is kept there too: each process
adds its refused logins and reads the sum, so one process's refusals hold back every process's
risky logins to that sshd.

A process calls the script when its sshd's use or demand changes (coalesced: one call in
flight, `GAP` between), at least every `RENEW` seconds, and when another process asks
(pub/sub: a process that got less than its fair level nudges the others, so that those above
it come down now rather than at their next renewal).

Redis lost (an error or `REDIS_TIMEOUT`): this process falls back at once to the static share
(budget / processes, `sshpool.static_share`), and for `TTL` after its last call that Redis may
have run no more than the lease that call may have left either (the other processes may still
hold theirs: the sum stays within the budget). A call whose answer timed out may have run (a
loaded Redis, late): it may have given slots back, so the lease it leaves is taken to be its
floor, and it counts as the last call. Redis back: leases are taken again, and for
`RETURN_GRACE` seconds no more than the static share, while the other processes, still on
theirs, register theirs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from typing import Any

from api.pubsub import listen, subscriber
from api.quota import PREFIX, REDIS_TIMEOUT
from sshpool import Sshd, StaticShare, static_share

log = logging.getLogger("sshapi.sshd_budget")

TTL = 8.0  # seconds a lease outlives its process's last call
RENEW = 1.0  # the longest pause between a process's calls
GAP = 0.05  # the shortest pause between calls (coalescing every change meanwhile)
RETRY = 0.5  # while Redis is lost: how often it is tried again
RETURN_GRACE = 2.0  # after Redis is back: seconds within the static share (> RETRY + a timeout)
NUDGE_EVERY = 0.2  # at most one nudge per sshd per this many seconds

CLOSE_WAIT = 2.0  # seconds a close asked of another process counts as room coming

# The keys of one sshd (after the prefix and the sshd's address:port), in LEASE's order.
PARTS = ("live", "c", "cw", "h", "hw", "pen", "idle", "closing")

# KEYS: live (zset process -> expiry), connection leases, connection wants, handshake leases,
# handshake wants (hashes process -> slots), penalty (hash score, at), idle connections (zset
# "process|ident" -> wall-clock time idle since), closes asked (zset "process|ident" -> until
# when the room counts as coming).
# ARGV: process, ttl, connections total, floor, wanted, handshakes total, floor, wanted,
# penalty seconds to add, pub/sub channel, sshd key, close wait, connections needed to keep
# the idle ones and serve every account waiting, n, the n idents of closes
# asked of this process and handled (closed, or not idle any more), then (since, ident) of
# each idle connection of this process.
# Returns {connection lease, connection cap, handshake lease, handshake cap, penalty score,
# connections leased in all, handshakes leased in all, live processes, wanted but not held,
# closes asked of other processes by this call, connections the others want beyond their
# leases}.
LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local me, ttl = ARGV[1], tonumber(ARGV[2])
local kidle, kclosing = KEYS[7], KEYS[8]

local function drop_of(zset, p)
  local mark = p .. '|'
  for _, m in ipairs(redis.call('ZRANGE', zset, 0, -1)) do
    if string.sub(m, 1, #mark) == mark then redis.call('ZREM', zset, m) end
  end
end

for _, p in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  for i = 2, 5 do redis.call('HDEL', KEYS[i], p) end
  drop_of(kidle, p)
  drop_of(kclosing, p)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, me)

-- Closes asked and never done within the wait (their owner gone): no longer room coming.
redis.call('ZREMRANGEBYSCORE', kclosing, '-inf', now)
local n = tonumber(ARGV[14])
for i = 15, 14 + n do redis.call('ZREM', kclosing, me .. '|' .. ARGV[i]) end
-- This process's idle connections, as it has them now (those asked to close stay out).
drop_of(kidle, me)
local own_idle = 0
for i = 15 + n, #ARGV, 2 do
  own_idle = own_idle + 1
  local m = me .. '|' .. ARGV[i + 1]
  if not redis.call('ZSCORE', kclosing, m) then redis.call('ZADD', kidle, ARGV[i], m) end
end
local spare = redis.call('ZCARD', kidle) + redis.call('ZCARD', kclosing)

local function share(kleases, kwants, total, floor, want, need, idle)
  redis.call('HSET', kwants, me, want)
  local lease, wants, demands = {}, {}, {}
  local l = redis.call('HGETALL', kleases)
  for i = 1, #l, 2 do lease[l[i]] = tonumber(l[i + 1]) end
  local w = redis.call('HGETALL', kwants)
  for i = 1, #w, 2 do
    wants[w[i]] = tonumber(w[i + 1])
    table.insert(demands, tonumber(w[i + 1]))
  end
  table.sort(demands)
  local left, level = total, total
  for i, d in ipairs(demands) do
    local even = left / (#demands - i + 1)
    if d >= even then level = even; break end
    left = left - d
  end
  local mine = lease[me] or 0
  local others, others_want, deficit, unmet = 0, false, 0, 0
  for p, n in pairs(lease) do if p ~= me then others = others + n end end
  for p, d in pairs(wants) do
    local n = lease[p] or 0
    if p ~= me then
      if d > n then others_want = true; unmet = unmet + d - n end
      deficit = deficit + math.max(0, math.min(d, math.floor(level)) - n)
    end
  end
  -- What it wants, or up to the fair level while others want more than they hold; with
  -- nobody short, its idle connections kept beside the new ones (free slots only).
  local target = math.max(want, need)
  if others_want then target = math.min(want, math.ceil(level)) end
  local free = total - others - mine
  local new, cap
  if target > mine then
    new = mine + math.max(0, math.min(free, target - mine))
    cap = new
  elseif deficit > free + idle and mine > target then
    -- Idle connections anywhere do not cover the others' due: come down to the level.
    new, cap = target, target
  elseif others_want then
    -- Give back the lease beyond what it holds; its idle connections close when asked.
    new = math.min(mine, math.max(want, floor))
    cap = new
  else
    new, cap = mine, mine
  end
  if new < floor then new = floor end
  if cap > new then cap = new end
  redis.call('HSET', kleases, me, new)
  return {new, cap, others + new, unmet + math.max(0, want - new), target, unmet}
end

local c = share(KEYS[2], KEYS[3], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[13]), spare)
local h = share(KEYS[4], KEYS[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), 0, 0)
for _, i in ipairs({1, 2, 3, 4, 5, 7, 8}) do redis.call('EXPIRE', KEYS[i], math.ceil(ttl) * 2) end

-- Still short with no free slot: ask the owners of the least recently used idle connections
-- of the sshd (other processes') to close them, as many as the wants no free slot or close
-- already asked covers, beyond this process's own idle ones (it closes those itself).
local asked = 0
local free = tonumber(ARGV[3]) - c[3]
local lack = math.min(c[5], tonumber(ARGV[5])) - c[1] - own_idle
local short = c[4] - redis.call('ZCARD', kclosing) - math.max(0, free)
local k = math.min(lack, short)
if k > 0 then
  local mark = me .. '|'
  for _, m in ipairs(redis.call('ZRANGE', kidle, 0, -1)) do
    if asked >= k then break end
    if string.sub(m, 1, #mark) ~= mark then
      redis.call('ZREM', kidle, m)
      redis.call('ZADD', kclosing, now + tonumber(ARGV[12]), m)
      redis.call('PUBLISH', ARGV[10], 'close ' .. ARGV[11] .. ' ' .. m)
      asked = asked + 1
    end
  end
end

local p = redis.call('HMGET', KEYS[6], 'score', 'at')
local score = math.max(0, (tonumber(p[1]) or 0) - (now - (tonumber(p[2]) or now)))
score = score + tonumber(ARGV[9])
if score > 0 then
  redis.call('HSET', KEYS[6], 'score', tostring(score), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[6], math.ceil(score) + 1)
end
return {c[1], c[2], h[1], h[2], tostring(score), c[3], h[3],
        redis.call('ZCARD', KEYS[1]), c[4] + h[4], asked, c[6]}
"""


class RedisBudget:
    """The sshds of this process's pool, their shares leased from Redis (see the module
    docstring); `loop` and `listen` are the supervisor's tasks (api/services.py). One per pool:
    it leases under one name for the process."""

    def __init__(
        self, url: str, processes: int, name: str, prefix: str = PREFIX, ttl: float = TTL
    ) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.from_url(
            url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT
        )
        self._sub = subscriber(url)
        self._lease = self._redis.register_script(LEASE)
        self.processes = processes
        self.ttl = ttl
        self.prefix = f"{prefix}sshd:"
        self.channel = f"{prefix}sshd-nudge"
        # Unique per process and start: a restarted process never inherits a dead one's lease.
        self.me = f"{name}:{os.getpid()}:{secrets.token_hex(4)}"
        self.sshds: list[Sshd] = []
        self._wake = asyncio.Event()
        # monotonic time of the last call Redis may have run (None: never a lease taken): a
        # lease taken, or a call that timed out since; of Redis's loss and return.
        self._leased_at: float | None = None
        self._lost_at: float | None = None
        self._back_at: float | None = None
        self._retry_at = 0.0
        # Per sshd key: its last lease (handshakes, connections); refusals already reported.
        self._leases: dict[str, tuple[int, int]] = {}
        self._reported: dict[str, int] = {}
        self._nudged: dict[str, float] = {}
        # Per sshd key: idents of the closes other processes asked of this one, handled or
        # under way, not yet reported to Redis as done.
        self._asked: dict[str, set[int]] = {}
        # Per sshd key: the idle connections last offered (given back with the leases).
        self._offered: dict[str, list[int]] = {}
        # Set while this coordinator changes a share itself: that change needs no new step.
        self._applying = False
        self._closed = False

    # ---- the Coordinator protocol (synchronous, no I/O) ----

    def attach(self, sshd: Sshd) -> None:
        self.sshds.append(sshd)
        if self._lost_at is not None:
            self._fallback(sshd, time.monotonic())
        else:
            # Nothing before the first lease: another process may hold the whole budget.
            sshd.share_mode = "redis"
            self._allow(sshd, 0, 0)
        self._wake.set()

    def changed(self, sshd: Sshd) -> None:
        if not self._applying:
            self._wake.set()

    # ---- the tasks ----

    async def loop(self) -> None:
        """Take, renew and give back this process's leases until cancelled."""
        while True:
            try:
                async with asyncio.timeout(RENEW):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            await self.step()
            await asyncio.sleep(GAP)

    async def listen(self) -> None:
        """Wake the loop on another process's nudge, until cancelled; Redis's failures are
        retried (api/pubsub.py), from RETRY on, and not logged: the loop's own calls say so."""
        await listen(self._sub, self.channel, self._heard, lambda _: None, first_retry=RETRY)

    def _heard(self, data: bytes) -> None:
        """A nudge (an sshd's key: step now), or "close <sshd key> <process>|<ident>": another
        process asks for the room of that idle connection of ours (the least recently used
        of the sshd's); closed if it still is idle (`Sshd.lend`), its room given back at the
        next step, which reports it done."""
        words = data.decode(errors="replace").split(" ")
        if len(words) == 3 and words[0] == "close":
            owner, _, ident = words[2].rpartition("|")
            if owner != self.me or not ident.isdigit():
                return
            for sshd in self.sshds:
                if sshd.key == words[1]:
                    if not sshd.lend(int(ident)):
                        sshd.counters["lend_declined"] += 1
                    self._asked.setdefault(sshd.key, set()).add(int(ident))
        self._wake.set()

    async def step(self) -> None:
        """One call per sshd; on a failure of Redis's, the static shares."""
        now = time.monotonic()
        if self._closed:
            return
        if self._lost_at is not None and now < self._retry_at:
            for sshd in self.sshds:
                self._fallback(sshd, now)
            return
        if self._lost_at is not None:
            self._back_at = now  # within the static share a while, once back (below)
        try:
            for sshd in list(self.sshds):
                await self._take(sshd)
        except Exception as exc:  # any Redis or network failure: static shares
            self._lost(exc)
        else:
            self._leased_at = time.monotonic()
            if self._lost_at is not None:
                self._lost_at = None
                log.warning("Redis is back: the sshd budgets are shared by all processes again")

    async def _take(self, sshd: Sshd) -> None:
        connecting, handshakes, used, wanted = sshd.demand()
        # What this process may reach before the reply is applied (its share is held there
        # meanwhile): the lease never drops below it, so a lease given back is never in use.
        floor_h = max(connecting, int(min(sshd.gate(), handshakes)))
        floor_c = max(used, int(min(sshd.budget(), wanted)))
        self._allow(sshd, min(sshd.share_handshakes, floor_h), min(sshd.share_connections, floor_c))
        # Should Redis run this call and its answer be lost, the lease it leaves may be as low
        # as the floors (slots given back, maybe leased by others already): the fallback never
        # goes above them (`_fallback`).
        last_h, before = self._leases.get(sshd.key, (floor_h, floor_c))
        self._leases[sshd.key] = (min(last_h, floor_h), min(before, floor_c))
        refused = sshd.penalties.refused - self._reported.get(sshd.key, 0)
        add = refused * sshd.penalties.per_failure
        keys = [f"{self.prefix}{sshd.key}:{part}" for part in PARTS]
        # Closes asked of this process and done (closed, or found busy): no more room coming.
        lending = set(sshd.lending)
        asked = self._asked.get(sshd.key, set())
        done = sorted(asked - lending)
        loop_now, wall_now = asyncio.get_running_loop().time(), time.time()
        offered = sshd.idle_connections()
        self._offered[sshd.key] = [ident for _, ident in offered]
        idle = [
            x for since, ident in offered for x in (f"{wall_now - (loop_now - since):.6f}", ident)
        ]
        reply = await self._lease(
            keys=keys,
            args=[
                *(self.me, self.ttl),
                *(int(sshd.max_total_connections), floor_c, wanted),
                *(sshd.max_handshakes, floor_h, handshakes),
                add,
                *(self.channel, sshd.key, CLOSE_WAIT, used + len(sshd.ring)),
                *(len(done), *done, *idle),
            ],
        )
        asked -= set(done)
        lease_c, cap_c, lease_h, cap_h = (int(x) for x in reply[:4])
        # A close for another process that ended during the call: the reply counted its room.
        cap_c = max(0, cap_c - len(lending - sshd.lending))
        sshd.counters["closes_asked"] += int(reply[9])
        self._reported[sshd.key] = sshd.penalties.refused
        self._leases[sshd.key] = (lease_h, lease_c)
        sshd.penalties.merge(float(reply[4]), asyncio.get_running_loop().time())
        sshd.shared = {
            "leased_connections": int(reply[5]),
            "leased_handshakes": int(reply[6]),
            "processes": int(reply[7]),
        }
        now = time.monotonic()
        if self._back_at is not None and now < self._back_at + RETURN_GRACE:
            cap_h = min(cap_h, int(static_share(sshd.max_handshakes, self.processes)))
            cap_c = min(cap_c, int(static_share(sshd.max_total_connections, self.processes)))
        sshd.share_mode = "redis"
        # Slots no process holds beyond what the others are short of: this share may grow
        # into them at its next step, so a full share waits for it rather than close one of
        # its idle connections (slots the others are short of go to them: it closes its own).
        room_before = sshd.room_coming
        free = int(sshd.max_total_connections) - int(reply[5])
        sshd.room_coming = free > int(reply[10])
        self._allow(sshd, cap_h, cap_c)
        if room_before and not sshd.room_coming:
            sshd.dispatch()
        if int(reply[8]) and (cap_c < wanted or cap_h < handshakes):
            await self._nudge(sshd.key, now)
        elif int(reply[8]) and lease_c < before:
            # Slots given back while others want them: they take them now, not at a renewal.
            await self._nudge(sshd.key, now, "freed")

    async def _nudge(self, key: str, now: float, why: str = "short") -> None:
        """This process got less than it wants (or gave slots back): ask the others to run
        their step now."""
        if now - self._nudged.get(f"{why}:{key}", 0.0) >= NUDGE_EVERY:
            self._nudged[f"{why}:{key}"] = now
            await self._redis.publish(self.channel, key)

    def _lost(self, exc: Exception) -> None:
        from redis.exceptions import TimeoutError as RedisTimeout  # imported with the client

        now = time.monotonic()
        self._retry_at = now + RETRY
        if self._leased_at is not None and isinstance(exc, TimeoutError | RedisTimeout):
            # No answer in time: Redis may have run the call (late, on a loaded box) and
            # renewed this process's lease, which then lasts TTL from now.
            self._leased_at = now
        if self._lost_at is None:
            self._lost_at = now
            log.warning(
                "Redis unreachable (%s): each sshd's budget is split statically over %d "
                "process(es) until it is back",
                exc,
                self.processes,
            )
        for sshd in self.sshds:
            self._fallback(sshd, now)

    def _fallback(self, sshd: Sshd, now: float) -> None:
        """The static share; within TTL of the last lease, no more than that lease either."""
        handshakes = static_share(sshd.max_handshakes, self.processes)
        connections = static_share(sshd.max_total_connections, self.processes)
        lease = self._leases.get(sshd.key)
        if lease is not None and self._leased_at is not None and now < self._leased_at + self.ttl:
            handshakes, connections = min(handshakes, lease[0]), min(connections, lease[1])
        elif (
            self.processes > 1
            and self._leased_at is None
            and now < (self._lost_at or now) + self.ttl
        ):
            # Never leased: the others may hold the whole budget until their leases lapse.
            # (One process: there are no others, and it serves at once.)
            handshakes = connections = 0
        sshd.share_mode = "fallback"
        sshd.shared = {}
        sshd.room_coming = False
        self._allow(sshd, handshakes, connections)

    def _allow(self, sshd: Sshd, handshakes: float, connections: float) -> None:
        if (handshakes, connections) != (sshd.share_handshakes, sshd.share_connections):
            self._applying = True
            try:
                sshd.allow(handshakes, connections)
            finally:
                self._applying = False

    async def close(self) -> None:
        """Give this process's leases back (best effort: they lapse within TTL anyway); called
        once its pool is closed."""
        self._closed = True
        try:
            for sshd in self.sshds:
                keys = [f"{self.prefix}{sshd.key}:{part}" for part in PARTS[:5]]
                idle = [f"{self.me}|{ident}" for ident in self._offered.get(sshd.key, [])]
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.zrem(keys[0], self.me)
                    for key in keys[1:]:
                        pipe.hdel(key, self.me)
                    if idle:
                        pipe.zrem(f"{self.prefix}{sshd.key}:idle", *idle)
                    await pipe.execute()
        except Exception as exc:
            log.info("could not give the sshd leases back (%s): they lapse in %g s", exc, self.ttl)
        for client in (self._redis, self._sub):
            with contextlib.suppress(Exception):  # a slow close must not fail the shutdown
                await client.aclose()


def make_coordinator(
    redis_url: str | None, processes: int, name: str
) -> RedisBudget | StaticShare | None:
    """Redis: leases (`RedisBudget`); without it, several processes: the static share; one
    process: none (it has each sshd's whole budget)."""
    if redis_url:
        return RedisBudget(redis_url, processes, name)
    return StaticShare(processes) if processes > 1 else None


def budgets(redis_url: str | None, processes: int, gate: int) -> int:
    """How many times its gate `processes` may have in flight to one sshd, for the start
    check and `sshapi doctor` (HostConfig.ssh_budget): once, shared through Redis or split in
    static shares; but each process keeps one handshake at least, so more processes than the
    gate's handshakes count once each."""
    return 1 if redis_url or processes <= gate else processes
