"""One target's pool (`HostPool`: its connections, their channel slots, the callers waiting for
one, its leases, kills and SFTP sessions); `sshpool.pool.Pool` keeps one per Target, and its
docstring tells how a command goes through it and the invariants kept here.

All mutable state lives here and changes only in synchronous methods (`_dispatch`,
`_maybe_grow`, `_release`, ...), so no two coroutines interleave inside a state change. I/O
(connect, exec, close) happens outside them; the connect path's is `sshpool.connect`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable
from typing import Any

from sshpool.agent import AgentConnection
from sshpool.backends import Backend
from sshpool.backends.base import SFTPSession
from sshpool.breaker import Breaker
from sshpool.budget import Sshd
from sshpool.connect import AgentMode, connect, log_connect_failure
from sshpool.durations import Durations
from sshpool.errors import (
    AuthenticationFailed,
    ChannelRefused,
    ConnectionLost,
    HostKeyMismatch,
    HostUnavailable,
    NotAdmitted,
    PoolFull,
    PoolTimeout,
    RemoteFileError,
    SSHPoolError,
)
from sshpool.lease import Lease, PooledConn, kill_group, retried
from sshpool.target import Target
from sshpool.tracing import waiting
from sshpool.waiters import Waiters

log = logging.getLogger("sshpool")

# How long the kill of a timed-out or cancelled command may take, all attempts included.
KILL_TIMEOUT = 5.0
CLOSE = "sshpool-close"  # the name of a connection's background close (`HostPool.close`)


class HostPool:
    def __init__(
        self,
        target: Target,
        backend: Backend,
        sshd: Sshd,
        admit: Callable[[Target, Hashable], bool] = lambda target, tenant: True,
    ) -> None:
        self.target = target
        self.admit = admit
        self.limits = target.limits
        self.backend = backend
        self.sshd = sshd
        self.conns: list[PooledConn] = []
        self.waiters = Waiters()
        # The waiters for an SFTP session (they need a connection with a channel to spare).
        self.sftp_waiters: set[asyncio.Future[PooledConn]] = set()
        self.connecting = 0
        # Set while prewarm() waits: min_connections is then a need, not a wish.
        self.prewarming = False
        self.connect_watchers: list[asyncio.Future[SSHPoolError | None]] = []
        self.breaker = Breaker(
            self.limits.breaker_threshold,
            self.limits.breaker_backoff,
            self.limits.breaker_backoff_max,
            self.limits.auth_backoff,
            self.limits.auth_backoff_max,
        )
        # Refused logins of every account of this sshd; this account may add one only while
        # it is not known good (it never logged in, or sshd refused it since).
        self.penalties = sshd.penalties
        self.trusted = False
        self.counters: Counter[str] = Counter()
        # Connections made (handshakes that succeeded), slots waited for (timed out ones too).
        self.create_time, self.wait_time = Durations(), Durations()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.loop = asyncio.get_running_loop()
        # Whether new connections start an executor (Target.exec_mode; `AgentMode`).
        self.agent = AgentMode(target)
        # A drained login node (sshpool.cluster): no new lease, no new connection.
        self.retired = False

    # ---- state changes: synchronous, no awaits ----

    def _pick(self, sftp: bool = False) -> PooledConn | None:
        best: PooledConn | None = None
        for c in self.conns:
            if c.has_room(sftp) and (best is None or c.in_use < best.in_use):
                best = c
        return best

    def _dispatch(self) -> None:
        """Hand free slots to waiters in their turns (see `Waiters`), then grow if waiters
        remain."""
        self._prune()
        while self.waiters:
            fut = self.waiters.peek()
            if fut.done():
                self.waiters.popleft()
                continue
            sftp = fut in self.sftp_waiters
            c = self._pick(sftp)
            if c is None:
                break
            self.waiters.popleft()
            self.sftp_waiters.discard(fut)
            self._lease(c, sftp)
            fut.set_result(c)
        self._maybe_grow()

    def _maybe_grow(self) -> None:
        """Ask the sshd for a connection when one is needed (see `wants_connection`)."""
        if self.wants_connection():
            self.sshd.want(self)

    def wants_connection(self) -> bool:
        """One new connection per connection's worth of waiters (`_connections_for_waiters`),
        up to max_connections; or one to keep min_connections open while the sshd has room.
        Asked by the sshd before each grant."""
        lim = self.limits
        opened = len(self.conns) + self.connecting
        now = self.loop.time()
        if self.retired or opened >= lim.max_connections or not self.breaker.may_try(now):
            return False
        if not self.trusted and (self.connecting or not self.penalties.allows(now)):
            # An account not known good may be refused: one login at a time, and only while
            # one more refusal stays under the sshd's penalty threshold (`Penalties`).
            return False
        if self.connecting < self._connections_for_waiters():
            return True
        return opened < lim.min_connections and (self.prewarming or self.sshd.has_spare_room(self))

    def _connections_for_waiters(self) -> int:
        """New connections that would serve every waiter: max_sessions channels each; in agent
        mode agent_max_commands commands each (the executor's cap, not MaxSessions) and
        max_sessions - 1 SFTP channels beside the executor's."""
        lim = self.limits
        waiting = len(self.waiters)
        if not self.agent.on:
            return -(-waiting // lim.max_sessions)
        sftp = len(self.sftp_waiters)
        return max(
            -(-max(0, waiting - sftp) // lim.agent_max_commands),
            -(-sftp // max(1, lim.max_sessions - 1)),
        )

    def start_connect(self) -> None:
        """The sshd granted a handshake."""
        self.breaker.allow(self.loop.time())
        self.connecting += 1
        self.spawn(self._connect())

    def evictable(self) -> list[tuple[float, PooledConn]]:
        return [(c.idle_since, c) for c in self.conns if c.in_use == 0 and not c.expired]

    def evict(self, c: PooledConn) -> None:
        """The sshd closes this idle connection to make room for another account's."""
        self.conns.remove(c)
        c.expired = c.for_room = True
        self.counters["evicted"] += 1
        self.spawn(self._close(c, evicted=True), CLOSE)

    def holds(self) -> tuple[int, int]:
        busy = sum(1 for c in self.conns if c.in_use)
        return busy, len(self.conns) - busy

    def retire(self, retired: bool) -> None:
        """A drained node (`retired`): its connections take no new lease and close once their
        channels end, its waiters are refused (a cluster moves them to another node); or back
        in service."""
        self.retired = retired
        if retired:
            for c in self.conns:
                c.expired = True
            self._fail_waiters(HostUnavailable(f"{self.target}: node drained", 1.0))
        self._dispatch()

    def _prune(self) -> None:
        """Drop dead and drained-expired connections (closing them in the background)."""
        keep: list[PooledConn] = []
        for c in self.conns:
            if c.in_use == 0 and (c.expired or not c.conn.is_alive()):
                self.spawn(self._close(c, evicted=c.for_room), CLOSE)
            else:
                keep.append(c)
        self.conns = keep

    def _lease(self, c: PooledConn, sftp: bool = False) -> None:
        c.in_use += 1
        if sftp and c.sftp_capacity is not None:
            c.sftp += 1
        if not self.limits.reuse:
            c.expired = True  # one command per connection: closed when this lease ends

    def _release(self, c: PooledConn) -> None:
        c.in_use -= 1
        if c.in_use == 0:
            c.idle_since = self.loop.time()
        if not c.expired and self.sshd.owes_room(self, self._open_conns()):
            # Another account waits for its turn at a full sshd: this account's connections
            # beyond its first go to it (drained, then closed) instead of to its own backlog;
            # or this process holds more than its share of the sshd (`Sshd.allow`).
            c.expired = c.for_room = True
            self.sshd.yielded()
        self._dispatch()
        if c.in_use == 0:
            self.sshd.idle()

    def _open_conns(self) -> int:
        return sum(1 for c in self.conns if not c.expired)

    def _discard(self, c: PooledConn) -> None:
        """The connection failed under a lease: take no more leases on it."""
        c.expired = True
        self._release(c)

    def _shrink(self, c: PooledConn) -> None:
        """sshd refused a channel: this connection's real limit is what it holds now."""
        c.in_use -= 1
        c.capacity = max(1, c.in_use)
        c.clean_opens = 0
        self.counters["channel_refused"] += 1
        self._dispatch()

    def _end_sftp(self, c: PooledConn) -> None:
        """An SFTP session's channel on `c` is closed (its command slot is released apart)."""
        if c.sftp_capacity is not None:
            c.sftp -= 1

    def _failed(self, c: PooledConn, exc: BaseException, sftp: bool = False) -> None:
        """A channel on `c` failed with `exc` (its open, or what ran on it): refused, the
        connection shrinks to what it holds now (an SFTP channel beside an executor: its SFTP
        channels do, its commands keep their room); lost or anything else, it is discarded."""
        if sftp:
            self._end_sftp(c)
        if isinstance(exc, ChannelRefused):
            if sftp and c.sftp_capacity is not None:
                c.sftp_capacity = max(1, c.sftp)
                c.clean_opens = 0
                self.counters["channel_refused"] += 1
                self._release(c)
            else:
                self._shrink(c)
            return
        if isinstance(exc, ConnectionLost):
            self.counters["connections_lost"] += 1
        self._discard(c)

    def _fail_waiters(self, exc: SSHPoolError) -> None:
        self.sftp_waiters.clear()
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(copy.copy(exc))

    # ---- I/O ----

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str = "") -> asyncio.Task[Any]:
        task = self.loop.create_task(coro, name=name or None)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _close(self, c: PooledConn, evicted: bool = False) -> None:
        try:
            await c.conn.close()
        finally:
            self.sshd.closed(evicted, c.ident)

    def _connected(self, result: SSHPoolError | None) -> None:
        for fut in self.connect_watchers:
            if not fut.done():
                fut.set_result(result)
        self.connect_watchers.clear()
        self._dispatch()
        self.sshd.dispatch()

    async def _connect(self) -> SSHPoolError | None:
        """Open one connection (the caller counted it in `connecting`); returns the error."""
        start = time.perf_counter()
        try:
            conn, slots, stages = await connect(
                self.backend, self.target, self.agent, self._wanted, self.counters
            )
        except SSHPoolError as exc:
            self.connecting -= 1
            self.sshd.connected(False)
            self.counters["connects_failed"] += 1
            if isinstance(exc, AuthenticationFailed):
                self.trusted = False
                self.penalties.failure(self.loop.time())
                self.breaker.auth_failure(self.loop.time())
            else:
                self.breaker.failure(self.loop.time())
            log_connect_failure(self.target, exc)
            live = any(c.conn.is_alive() and not c.expired for c in self.conns)
            if isinstance(exc, (AuthenticationFailed, HostKeyMismatch)) or (
                not live and self.connecting == 0
            ):
                # Nothing will free a slot for them: tell the waiters now, not at their deadline.
                self._fail_waiters(exc)
            self._connected(exc)
            return exc
        except BaseException:
            self.connecting -= 1
            self.sshd.connected(False)
            raise
        now = self.loop.time()
        self.connecting -= 1
        self.sshd.connected(True)
        self.counters["connects"] += 1
        self.breaker.success()
        self.trusted = True
        # Beside an executor's channel, the SFTP sessions' (at least one: see ssh_budget).
        sftp = max(1, self.limits.max_sessions - 1) if isinstance(conn, AgentConnection) else None
        self.create_time.observe(took := time.perf_counter() - start)
        self.conns.append(PooledConn(conn, slots, now, took, sftp, stages))
        self._connected(None)
        return None

    def _wanted(self) -> bool:
        """Do callers still wait for a connection (a dropped handshake is tried again)?"""
        return bool(self.waiters or self.connect_watchers)

    def _admitted(self, tenant: Hashable) -> None:
        if not self.admit(self.target, tenant):
            self.counters["refused_gate"] += 1
            raise NotAdmitted(f"{self.target}: refused by the gate")

    async def acquire(
        self,
        deadline: float | None,
        tenant: Hashable = None,
        sftp: bool = False,
        gated: bool = True,
    ) -> PooledConn:
        """A slot (`sftp`: for an SFTP session, which needs a channel too), in `tenant`'s turn.
        `gated`: the gate is asked now and once the slot is granted (NotAdmitted, the slot
        given back); the pool's own kills are not gated (a revoked caller's command must die)."""
        if gated:
            self._admitted(tenant)
        if self.retired:
            raise HostUnavailable(f"{self.target}: node drained", 1.0)
        if not self.waiters:
            c = self._pick(sftp)
            if c is not None:
                self._lease(c, sftp)
                self.wait_time.observe(0.0)
                return c
        now = self.loop.time()
        if self.breaker.is_open(now) and not any(c.conn.is_alive() for c in self.conns):
            self.counters["refused_breaker"] += 1
            retry = self.breaker.retry_after(now)
            raise HostUnavailable(f"{self.target}: host down, retry in {retry:.1f} s", retry)
        if len(self.waiters) >= self.limits.max_waiters:
            self.counters["refused_full"] += 1
            raise PoolFull(f"{self.target}: {len(self.waiters)} callers already waiting")
        fut: asyncio.Future[PooledConn] = self.loop.create_future()
        self.waiters.append(tenant, fut)
        if sftp:
            self.sftp_waiters.add(fut)
        self._maybe_grow()
        try:
            async with asyncio.timeout_at(deadline):
                # Shielded: on timeout or cancel we decide what happens to the waiter below.
                c = await asyncio.shield(fut)
            self.wait_time.observe(self.loop.time() - now)
        except BaseException as exc:
            self.sftp_waiters.discard(fut)
            if not fut.done():
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(tenant, fut)
            elif not fut.cancelled() and fut.exception() is None:
                # Served at the same moment we gave up: give the slot back.
                if sftp:
                    self._end_sftp(fut.result())
                self._release(fut.result())
            if isinstance(exc, TimeoutError):
                self.wait_time.observe(self.loop.time() - now)
                self.counters["timeouts_queue"] += 1
                raise PoolTimeout(f"{self.target}: no channel free before the deadline") from None
            raise
        if gated and not self.admit(self.target, tenant):
            # Refused while it waited: nothing starts; the slot goes to the next waiter.
            if sftp:
                self._end_sftp(c)
            self._release(c)
            self._admitted(tenant)
        return c

    @contextlib.asynccontextmanager
    async def lease(
        self, deadline: float | None, since: float, tenant: Hashable = None, gated: bool = True
    ) -> AsyncIterator[Lease]:
        """A channel slot for one exec (`since`: when the caller started, for the queue time;
        `tenant`: whose turn it waits for). How the body ends decides what becomes of the slot:

        - cleanly: released (and a shrunk connection earns back capacity);
        - ChannelRefused: the connection shrinks to what it holds now;
        - ConnectionLost or any other failure: the connection is discarded;
        - TimeoutError (the command's timeout): the remote group is killed, then released;
        - cancelled: killed and released in the background, so the caller returns at once.
        """
        acquiring = self.acquire(deadline, tenant, gated=gated)  # traced: sshpool.tracing
        lease = Lease(await waiting(acquiring, self.target, self.backend.name), since)
        c = lease.conn
        try:
            yield lease
        except TimeoutError:
            self.counters["timeouts_command"] += 1
            await self._kill(c, lease.pgid)
            raise
        except asyncio.CancelledError:
            self.counters["cancelled"] += 1
            self.spawn(self._kill(c, lease.pgid))
            raise
        except BaseException as exc:
            # Once per connection, however many leases it carried (`_failed` expires it).
            lost = isinstance(exc, ConnectionLost) and lease.t_started is None
            if lost and not c.served and not c.expired:
                self.breaker.lost_before_start(self.loop.time())
            self._failed(c, exc)
            raise
        if not c.served:
            c.served = True
            self.breaker.served()
        c.regrow()
        self._release(c)

    async def _kill(self, c: PooledConn, pgid: int | None) -> None:
        """Kill the remote process group, then give the lease back (its sshd session slot stays
        taken until the remote command exits)."""
        try:
            if pgid is not None:
                async with asyncio.timeout(KILL_TIMEOUT):
                    try:
                        # The lease's own connection has a spare sshd session slot
                        # (max_sessions < MaxSessions).
                        await kill_group(c.conn, pgid)
                    except (ChannelRefused, ConnectionLost):
                        other = await self.acquire(None, gated=False)
                        try:
                            await kill_group(other.conn, pgid)
                        finally:
                            self._release(other)
                    self.counters["killed"] += 1
        except (SSHPoolError, TimeoutError) as exc:
            self.counters["kill_failed"] += 1
            log.warning("could not kill process group %s on %s: %s", pgid, self.target, exc)
        finally:
            self._release(c)

    async def kill(self, pgid: int) -> None:
        """Kill a process group started elsewhere, on a slot of its own, within KILL_TIMEOUT."""
        c = await self.acquire(self.loop.time() + KILL_TIMEOUT, gated=False)
        try:
            async with asyncio.timeout(KILL_TIMEOUT):
                await kill_group(c.conn, pgid)
            self.counters["killed"] += 1
        finally:
            self._release(c)

    async def open_sftp(
        self, deadline: float | None, since: float, tenant: Hashable = None
    ) -> tuple[PooledConn, SFTPSession]:
        """A channel slot with the sftp subsystem started on it (see `Pool.sftp`), waited for
        in `tenant`'s turns like a command's and retried as a command's (`retried`: a
        session's open that fails raises started=False)."""
        return await retried(self.target, functools.partial(self._open_sftp, deadline, tenant))

    async def _open_sftp(
        self, deadline: float | None, tenant: Hashable
    ) -> tuple[PooledConn, SFTPSession]:
        """One try of `open_sftp`: the slot goes as a command's does when its channel fails
        (`_failed`)."""
        acquiring = self.acquire(deadline, tenant, sftp=True)
        c = await waiting(acquiring, self.target, self.backend.name)
        try:
            session = await c.conn.sftp()
        except RemoteFileError:
            self._end_sftp(c)
            self._release(c)  # no sftp subsystem: the connection itself is fine
            raise
        except BaseException as exc:
            self._failed(c, exc, sftp=True)
            raise
        c.regrow()
        self.counters["sftp_sessions"] += 1
        c.leases += 1
        return c, session

    async def close_sftp(self, c: PooledConn, session: SFTPSession, healthy: bool) -> None:
        """Close an SFTP session's channel, then release its slot (or discard the connection
        when the session ended on a broken connection)."""
        try:
            async with asyncio.timeout(KILL_TIMEOUT):
                await session.close()
        except TimeoutError:
            healthy = False
        self._end_sftp(c)
        if healthy and c.conn.is_alive():
            self._release(c)
        else:
            self._discard(c)

    async def prewarm(self) -> None:
        """Open limits.min_connections now, through the sshd's gate and budget; raises the
        connect error if one failed."""
        while len(self.conns) < self.limits.min_connections:
            fut: asyncio.Future[SSHPoolError | None] = self.loop.create_future()
            self.connect_watchers.append(fut)
            self.prewarming = True
            try:
                self._maybe_grow()
                if self.connecting == 0 and not fut.done() and not self.sshd.is_queued(self):
                    retry = self.breaker.retry_after(self.loop.time())
                    message = f"{self.target}: host down, retry in {retry:.1f} s"
                    raise HostUnavailable(message, retry)
                error = await fut
            finally:
                self.prewarming = False
            if error is not None:
                raise error

    async def close(self) -> None:
        self._fail_waiters(PoolTimeout("pool closed"))
        self.connect_watchers.clear()
        # Background closes run to their end: one cancelled unstarted never closes its socket.
        tasks = [t for t in self.tasks if t.get_name() != CLOSE]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        conns, self.conns = self.conns, []
        closing = [t for t in self.tasks if t.get_name() == CLOSE]
        await asyncio.gather(*(c.conn.close() for c in conns), *closing, return_exceptions=True)

    async def discard(self) -> int:
        """Close every connection now (`Pool.discard`) through the sshd's budget, in closes the
        pool's close waits for too; the account stays a member of its sshd, with its breaker."""
        self._fail_waiters(PoolTimeout(f"{self.target}: its connections were closed"))
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=KILL_TIMEOUT)
        conns, self.conns = self.conns, []
        for c in conns:
            c.expired = True
        closes = [self.spawn(self._close(c), CLOSE) for c in conns]
        await asyncio.gather(*closes, return_exceptions=True)
        self.counters["discarded"] += len(conns)
        return len(conns)

    def maintain(self) -> None:
        """Expire old connections, close idle ones beyond min_connections, top up the minimum."""
        now = self.loop.time()
        idle_closable = len(self.conns) - self.limits.min_connections
        for c in self.conns:
            if now - c.created > self.limits.max_lifetime:
                c.expired = True
            elif (
                idle_closable > 0
                and c.in_use == 0
                and now - c.idle_since > self.limits.idle_timeout
            ):
                c.expired = True
                idle_closable -= 1
        self._dispatch()

    def stats(self) -> dict[str, Any]:
        live = [c for c in self.conns if c.conn.is_alive()]
        agents = sum(1 for c in live if isinstance(c.conn, AgentConnection))
        return {
            "target": str(self.target),
            "backend": self.backend.name,
            # The next connection's mode; the live ones' own ("auto" decides per connection).
            "exec_mode": "agent" if self.agent.on else "channel",
            "connections_by_mode": {"agent": agents, "channel": len(live) - agents},
            "agent_error": self.agent.error,
            "connections": len(live),
            "connections_used": sum(1 for c in live if c.in_use),
            "channels_in_use": sum(c.in_use for c in self.conns),
            "capacity": sum(c.capacity for c in live if not c.expired),
            "waiters": sum(1 for f in self.waiters if not f.done()),
            "handshakes_in_flight": self.connecting,
            "sshd": self.sshd.key,
            "breaker": self.breaker.state,
            "breaker_retry_after": round(self.breaker.retry_after(self.loop.time()), 3),
            "counters": dict(self.counters),
        }
