"""The connection pool: keeps SSH connections open per Target and multiplexes commands as channels.

Per target (`_HostPool`), all mutable state lives in one place and changes only in synchronous
methods (`_dispatch`, `_maybe_grow`, `_release`, ...), so no two coroutines interleave inside a
state change. I/O (connect, exec, close) happens outside them.

A command holds a lease (`async with host.lease(deadline)`), one channel slot on one
connection (an SFTP session holds one the same way while open: `Pool.sftp`; on an executor's
connection, agent mode, a slot is one of the executor's commands, and an SFTP session holds one
of the connection's own channels besides: `PooledConn.sftp`); the lease
decides what becomes of the slot when the command ends: released after a
clean exec, shrunk when sshd refused the channel, discarded when the connection failed, and after
a timeout or cancellation released only once the remote process group was killed. The
connection's bookkeeping and the exec on a slot are `sshpool.lease`'s; the waiters' turns are
`sshpool.waiters`'.

Every host pool reaches one sshd (`sshpool.budget.Sshd`, shared by all the accounts that reach
the same address and port): it asks it for each new connection, and the sshd grants handshakes
in turns, within its gate and its connection budget, closing other accounts' idle connections
for room.

Invariants of a host pool:
- 0 <= conn.in_use <= conn.capacity <= limits.max_sessions for every pooled connection
  (limits.agent_max_commands on an executor's);
- on an executor's connection, 0 <= conn.sftp <= conn.sftp_capacity <= limits.max_sessions - 1:
  with the executor's own channel, at most max_sessions channels, however many commands run;
- len(conns) + connecting <= limits.max_connections;
- a connection is opened only when the sshd grants it (`start_connect`): the handshake gate
  (max_handshakes; stock MaxStartups drops from 10) and max_total_connections are the sshd's;
- a connection to keep min_connections open is asked for only while the sshd has spare room
  (no other account's closed for it, none queued needing it); waiters' connections may make
  room;
- waiters take turns by tenant (`Pool.run(..., tenant=...)`, `Pool.sftp(..., tenant=...)`):
  each tenant's waiters are served in FIFO order, and tenants with waiters are served round
  robin, one slot each per turn (a command or an SFTP session alike), so one tenant's backlog
  delays another's command by at most one turn (`Waiters`);
  callers without a tenant share one queue (plain FIFO among them);
- a new caller never takes a free slot while others wait;
- a caller the application's gate (`Pool.admit`) refuses starts nothing: it is asked when the
  caller comes and again when its slot is granted, right before the channel opens (the
  executor's START, the SFTP session); the pool's own work (kills, probes) is not asked;
- len(waiters) <= limits.max_waiters, counted over all tenants;
- an expired or dead connection takes no new lease and is closed once it has none;
- every connection made is reported closed to the sshd once its close is done;
- a handshake sshd drops (MaxStartups) is retried, paced, while callers still wait for it:
  they get PoolTimeout at their deadline, never the drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import math
import random
import socket
import time
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Hashable,
    Sequence,
)
from typing import Any, TypeVar, cast

from sshpool.agent import AgentConnection, start_agent
from sshpool.backends import Backend, Connection, load_backend
from sshpool.backends.base import SFTPSession
from sshpool.breaker import Breaker, Penalties
from sshpool.budget import Coordinator, Sshd
from sshpool.cluster import Router
from sshpool.command import (
    Capture,
    CommandResult,
    OutputStream,
    command_line,
    kill_group_line,
)
from sshpool.errors import (
    AgentUnavailable,
    AuthenticationFailed,
    ChannelRefused,
    CommandTimeout,
    ConnectError,
    ConnectionLost,
    HostKeyMismatch,
    HostUnavailable,
    NotAdmitted,
    PoolFull,
    PoolTimeout,
    RemoteFileError,
    SSHPoolError,
)
from sshpool.lease import Lease, PooledConn
from sshpool.target import Target
from sshpool.waiters import Waiters

log = logging.getLogger("sshpool")

T = TypeVar("T")

# How often the maintenance task prunes dead, idle and expired connections.
MAINTENANCE_INTERVAL = 1.0
# After this many clean channel opens since the last refusal, a shrunk capacity grows back by one.
REGROW_AFTER = 100
# A lease refused this many times in a row gives up (sshd refuses even a lone channel).
MAX_REFUSALS = 20
# How long the kill of a timed-out or cancelled command may take, all attempts included.
KILL_TIMEOUT = 5.0
# The pause before retrying a handshake sshd dropped: doubles from the first to the cap, with
# jitter, while the attempt keeps its place in the handshake gate (so the gate slows down too).
DROP_PAUSE = 0.1
DROP_PAUSE_MAX = 2.0
# Dropped handshakes that failed a connect are logged once per this many seconds, all pools and
# accounts together: a storm drops thousands, and one line per drop buries everything else.
DROP_LOG_EVERY = 5.0


class _Throttle:
    """One log line per `every` seconds at most; how many were held back goes in the next."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.next = 0.0
        self.held = 0

    def allow(self) -> int | None:
        """The lines held back since the last one allowed, or None: hold this one back."""
        now = time.monotonic()
        if now < self.next:
            self.held += 1
            return None
        held, self.held, self.next = self.held, 0, now + self.every
        return held


_drop_log = _Throttle(DROP_LOG_EVERY)


async def _resolve(host: str, port: int) -> str:
    """The address a host name resolves to (the first); the name itself when it does not."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return str(infos[0][4][0])
    except (OSError, IndexError):
        return host  # the connect will say what is wrong


async def _kill_exec(conn: Connection, pgid: int) -> None:
    """The one kill: TERM the remote process group, KILL it after a grace period."""
    await conn.exec(kill_group_line(pgid), None, Capture(4096), Capture(4096))


class _HostPool:
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
        self.tasks: set[asyncio.Task[Any]] = set()
        self.loop = asyncio.get_running_loop()
        # Agent mode until a connection finds no usable python3 (then channels, for good).
        self.agent = target.exec_mode == "agent"
        self.agent_error: str | None = None
        # Why this host's executors are not undumpable (no prctl there), once seen; logged once.
        self.agent_exposed: str | None = None
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
        if not self.agent:
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
        self.spawn(self._close(c, evicted=True))

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
                self.spawn(self._close(c, evicted=c.for_room))
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

    def _regrow(self, c: PooledConn) -> None:
        """A clean channel open: after REGROW_AFTER of them a shrunk connection grows by one."""
        c.clean_opens += 1
        if c.clean_opens >= REGROW_AFTER:
            if c.capacity < c.ceiling:
                c.capacity += 1
                c.clean_opens = 0
            if c.sftp_capacity is not None and c.sftp_capacity < (c.sftp_ceiling or 0):
                c.sftp_capacity += 1
                c.clean_opens = 0

    def _fail_waiters(self, exc: SSHPoolError) -> None:
        self.sftp_waiters.clear()
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(copy.copy(exc))

    # ---- I/O ----

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _close(self, c: PooledConn, evicted: bool = False) -> None:
        try:
            await c.conn.close()
        finally:
            self.sshd.closed(evicted)

    async def _handshake(self) -> Connection:
        """backend.connect, again after a drop (a reset before the banner: sshd shedding load,
        MaxStartups) while callers still wait for it, paced; per_sshd=False: once."""
        drops = 0
        while True:
            try:
                return await self.backend.connect(self.target)
            except ConnectError as exc:
                drops += 1
                if not exc.retryable or (
                    drops > 1
                    and not (self.limits.per_sshd and (self.waiters or self.connect_watchers))
                ):
                    raise
                self.counters["connect_retries"] += 1
                pause = min(DROP_PAUSE * 2 ** (drops - 1), DROP_PAUSE_MAX)
                await asyncio.sleep(random.uniform(pause / 2, pause))

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
            conn = await self._handshake()
            conn, slots = await self._with_agent(conn)
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
            self._log_connect_failure(exc)
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
        self.conns.append(PooledConn(conn, slots, now, time.perf_counter() - start, sftp))
        self._connected(None)
        return None

    def _log_connect_failure(self, exc: SSHPoolError) -> None:
        """One line per failed connect, but drops (sshd shedding load) once per DROP_LOG_EVERY
        over all pools, with the count of those held back."""
        if not (isinstance(exc, ConnectError) and exc.retryable):
            log.warning("connect to %s failed: %s", self.target, exc)
            return
        held = _drop_log.allow()
        if held is not None:
            more = f" ({held} more dropped handshakes not logged)" if held else ""
            log.warning("connect to %s failed: %s%s", self.target, exc, more)

    async def _with_agent(self, conn: Connection) -> tuple[Connection, int]:
        """In agent mode, `conn` with its executor started, and the commands it may run at
        once. A host without a usable python3 turns this pool to channel mode, with one log
        line; a connection lost meanwhile is a failed connect."""
        if not self.agent:
            return conn, self.limits.max_sessions
        n = self.limits.agent_max_commands
        try:
            # Two more for the executor than the pool leases: kills of timed-out commands.
            agent = await start_agent(
                conn,
                n + 2,
                python=self.target.agent_python,
                timeout=self.limits.agent_start_timeout,
            )
        except AgentUnavailable as exc:
            if not conn.is_alive():
                await conn.close()
                raise ConnectionLost(str(exc), started=False) from None
            if self.agent:
                self.agent = False
                self.agent_error = str(exc)
                log.warning(
                    "%s: %s; this host's commands run as channels instead", self.target, exc
                )
            return conn, self.limits.max_sessions
        except BaseException:
            await conn.close()
            raise
        if agent.preamble:
            log.warning(
                "the login printed %d bytes before the executor started (not output): %r",
                len(agent.preamble),
                agent.preamble[:200],
            )
        exposed = agent.hello.get("exposed")
        if exposed and self.agent_exposed is None:
            self.agent_exposed = str(exposed)[:300]
            log.warning(
                "%s: the executor could not make itself undumpable (%s): commands of this "
                "account can open its channel through /proc",
                self.target,
                self.agent_exposed,
            )
        self.counters["agents_started"] += 1
        return agent, n

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
        lease = Lease(await self.acquire(deadline, tenant, gated=gated), since)
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
            self._failed(c, exc)
            raise
        self._regrow(c)
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
                        await _kill_exec(c.conn, pgid)
                    except (ChannelRefused, ConnectionLost):
                        other = await self.acquire(None, gated=False)
                        try:
                            await _kill_exec(other.conn, pgid)
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
                await _kill_exec(c.conn, pgid)
            self.counters["killed"] += 1
        finally:
            self._release(c)

    async def retried(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` (take a slot, open a channel on it, use it), again while it fails before
        anything ran: after a refused channel (the connection already shrunk) with a growing
        pause, up to MAX_REFUSALS in a row; after a connection lost before the start
        (ConnectionLost(started=False), the connection already discarded) once, on a fresh
        connection. The one retry policy of commands and SFTP sessions alike."""
        refusals = 0
        lost_retried = False
        while True:
            try:
                return await attempt()
            except ChannelRefused:
                refusals += 1
                if refusals >= MAX_REFUSALS:
                    raise ConnectionLost(
                        f"{self.target}: sshd refused {refusals} channels in a row", started=False
                    ) from None
                await asyncio.sleep(0.005 * refusals)
            except ConnectionLost as exc:
                if exc.started or lost_retried:
                    raise
                lost_retried = True  # it never ran: once more, on a fresh connection

    async def open_sftp(
        self, deadline: float | None, since: float, tenant: Hashable = None
    ) -> tuple[PooledConn, SFTPSession]:
        """A channel slot with the sftp subsystem started on it (see `Pool.sftp`), waited for
        in `tenant`'s turns like a command's and retried as a command's (`retried`: a
        session's open that fails raises started=False)."""
        return await self.retried(functools.partial(self._open_sftp, deadline, tenant))

    async def _open_sftp(
        self, deadline: float | None, tenant: Hashable
    ) -> tuple[PooledConn, SFTPSession]:
        """One try of `open_sftp`: the slot goes as a command's does when its channel fails
        (`_failed`)."""
        c = await self.acquire(deadline, tenant, sftp=True)
        try:
            session = await c.conn.sftp()
        except RemoteFileError:
            self._end_sftp(c)
            self._release(c)  # no sftp subsystem: the connection itself is fine
            raise
        except BaseException as exc:
            self._failed(c, exc, sftp=True)
            raise
        self._regrow(c)
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
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        conns, self.conns = self.conns, []
        await asyncio.gather(*(c.conn.close() for c in conns), return_exceptions=True)

    async def discard(self) -> int:
        """Close every connection now (see `Pool.discard`), through the sshd's budget like any
        close; the account stays a member of its sshd, with its breaker."""
        self._fail_waiters(PoolTimeout(f"{self.target}: its connections were closed"))
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=KILL_TIMEOUT)
        conns, self.conns = self.conns, []
        for c in conns:
            c.expired = True
        await asyncio.gather(*(self._close(c) for c in conns), return_exceptions=True)
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
        return {
            "target": str(self.target),
            "backend": self.backend.name,
            "exec_mode": "agent" if self.agent else "channel",
            "agent_error": self.agent_error,
            "connections": len(live),
            "channels_in_use": sum(c.in_use for c in self.conns),
            "capacity": sum(c.capacity for c in live if not c.expired),
            "waiters": sum(1 for f in self.waiters if not f.done()),
            "handshakes_in_flight": self.connecting,
            "sshd": self.sshd.key,
            "breaker": self.breaker.state,
            "breaker_retry_after": round(self.breaker.retry_after(self.loop.time()), 3),
            "counters": dict(self.counters),
        }


class Pool:
    """SSH connections kept open per Target; commands run as channels on them.

    ```python
    async with Pool() as pool:
        result = await pool.run(target, ["echo", "hi"], timeout=10)
    ```
    """

    def __init__(
        self, backend: str | Backend = "asyncssh", coordinator: Coordinator | None = None
    ) -> None:
        self.backend = load_backend(backend) if isinstance(backend, str) else backend
        # Shares each sshd's gate and budget with other processes (`sshpool.budget`); None:
        # this process has them all.
        self.coordinator = coordinator
        self._backends: dict[str, Backend] = {self.backend.name: self.backend}
        self._hosts: dict[Target, _HostPool] = {}
        # (address, port) -> its budget; host name and port -> the address it resolved to.
        self._sshds: dict[tuple[str, int], Sshd] = {}
        self._addresses: dict[tuple[str, int], asyncio.Future[str]] = {}
        # Callers entering per (host name, port), and the FIFO lock they enter through (`_host`).
        self._entering: Counter[tuple[str, int]] = Counter()
        self._entries: dict[tuple[str, int], asyncio.Lock] = {}
        self._maintenance: asyncio.Task[None] | None = None
        self._closed = False
        # Targets with `nodes` (login-node clusters) are routed to one node's target each.
        self._router = Router(self)
        # The application's gate: may `tenant` (what the caller passed) start SSH work on
        # `target` now? Asked before every command and SFTP session starts (see the module's
        # invariants); the API refuses a revoked identity or account this way (api/revocations.py).
        self.admit: Callable[[Target, Hashable], bool] = lambda target, tenant: True

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _host(self, target: Target) -> _HostPool:
        if self._closed:
            raise RuntimeError("pool is closed")
        name = (target.host, target.port)
        host = self._hosts.get(target)
        if host is None or self._entering[name]:
            # Callers enter in arrival order (where the waiters' FIFO starts): the first awaits
            # the name's lookup, the others queue behind it on a FIFO lock, and none overtakes
            # them through a host pool made meanwhile (an `await` of a done future does not
            # yield, so a latecomer would otherwise run before the woken ones).
            self._entering[name] += 1
            try:
                async with self._entries.setdefault(name, asyncio.Lock()):
                    host = self._hosts.get(target) or await self._new_host(target)
            finally:
                self._entering[name] -= 1
                if not self._entering[name]:
                    del self._entering[name]
        if self._maintenance is None:
            self._maintenance = asyncio.create_task(self._maintain())
        return host

    async def _new_host(self, target: Target) -> _HostPool:
        sshd = await self._sshd(target)
        name = target.backend or self.backend.name
        if name not in self._backends:
            self._backends[name] = load_backend(name)
        host = self._hosts[target] = _HostPool(
            target, self._backends[name], sshd, lambda t, tenant: self.admit(t, tenant)
        )
        lim = target.limits
        sshd.join(host, lim.max_handshakes, lim.max_total_connections)
        return host

    async def _sshd(self, target: Target) -> Sshd:
        """The budget of the sshd `target` reaches: by the address its host name resolves to
        (once per pool) and its port; a target with per_sshd=False has one of its own."""
        lim = target.limits
        if not lim.per_sshd:
            own = Sshd(str(target), lim.max_handshakes, math.inf)
            own.penalties = Penalties(lim.penalty_per_failure, lim.penalty_threshold)
            return own
        name = (target.host, target.port)
        resolved = self._addresses.get(name)
        if resolved is None:
            # One lookup per name (its callers enter one by one: `_host`).
            resolved = self._addresses[name] = asyncio.ensure_future(_resolve(*name))
        address = await resolved
        key = (address, target.port)
        sshd = self._sshds.get(key)
        if sshd is None:
            where = f"[{address}]:{target.port}" if ":" in address else f"{address}:{target.port}"
            sshd = self._sshds[key] = Sshd(where, lim.max_handshakes, lim.max_total_connections)
            sshd.penalties = Penalties(lim.penalty_per_failure, lim.penalty_threshold)
            if self.coordinator is not None:
                sshd.coordinate(self.coordinator)
        return sshd

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(MAINTENANCE_INTERVAL)
            for host in list(self._hosts.values()):
                host.maintain()

    async def prewarm(self, target: Target) -> None:
        """Open target.limits.min_connections now, through the handshake gate; raises the
        connect error if one failed. A cluster's: on every node up."""
        if target.nodes:
            for node in self._router.cluster(target).candidates():
                await self.prewarm(target.node_target(node))
            return
        await (await self._host(target)).prewarm()

    async def run(
        self,
        target: Target,
        command: str | Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        acquire_timeout: float | None = None,
        max_output: int = 1 << 20,
        on_started: Callable[[int], None] | None = None,
        on_output: Callable[[OutputStream, bytes], None] | None = None,
        tenant: Hashable = None,
        on_node: Callable[[str], None] | None = None,
        gated: bool = True,
    ) -> CommandResult:
        """Run `command` (argv, quoted for the remote shell, or a raw shell line) on `target`.

        When the target's slots are all taken, callers wait in turns by `tenant` (any hashable:
        the API passes the job's owner): FIFO within a tenant, round robin across tenants, so a
        tenant with a long backlog delays another tenant by at most one turn. Without a tenant,
        callers share one FIFO queue.

        Raises PoolTimeout, PoolFull, HostUnavailable, NotAdmitted (`admit` refused `tenant`;
        `gated=False`: not asked, for work that ends or reads a refused caller's, such as a
        scancel), ConnectTimeout, ConnectError, CommandTimeout (with the partial result) or
        ConnectionLost(started=True). Cancelling the
        caller kills the remote process group. `on_started(pgid)` is called once the remote
        command runs, with its process group id (what `kill` takes).

        `on_output(stream, chunk)` ("stdout" or "stderr") sees every chunk of output as the
        channel delivers it, beyond `max_output` too (the result keeps only the head): called
        on the event loop inside the backend's drain, so it must be cheap and never block (see
        `Capture`). The command's own output comes after the start (the wrapper's marker line),
        so the pool's one retry of a connection lost before the start repeats none of it.

        On a cluster (`target.nodes`) the command runs on one node (`sshpool.cluster`), moving
        to another while it has not started there; `on_node(node)` is called as it starts,
        before `on_started`. NodeFailed (a ConnectionLost, started) when that node failed
        under it.
        """
        if not isinstance(command, str):
            command_line(command)  # refuse an empty argv or a NUL before taking a slot
        if target.nodes:
            return cast(
                CommandResult,
                await self._router.run(
                    target,
                    acquire_timeout,
                    command=command,
                    stdin=stdin,
                    timeout=timeout,
                    max_output=max_output,
                    on_started=on_started,
                    on_output=on_output,
                    tenant=tenant,
                    on_node=on_node,
                    gated=gated,
                ),
            )
        host = await self._host(target)
        # Stage timings use perf_counter: uvloop's loop.time() only ticks in milliseconds.
        t0 = time.perf_counter()
        deadline = None if acquire_timeout is None else host.loop.time() + acquire_timeout

        async def attempt() -> CommandResult:
            try:
                async with host.lease(deadline, t0, tenant, gated) as lease:
                    async with asyncio.timeout(timeout):
                        end = await lease.exec(command, stdin, max_output, on_started, on_output)
            except TimeoutError:
                # The lease killed the remote group before letting go of the slot.
                result = lease.result(None)
                raise CommandTimeout(f"command ran past its {timeout} s timeout", result) from None
            host.counters["commands"] += 1
            return lease.result(end)

        return await host.retried(attempt)

    @contextlib.asynccontextmanager
    async def sftp(
        self, target: Target, *, acquire_timeout: float | None = None, tenant: Hashable = None
    ) -> AsyncIterator[SFTPSession]:
        """An SFTP session on a pooled connection to `target`, held for the `async with` body
        (several operations may use it, one at a time).

        ```python
        async with pool.sftp(target, acquire_timeout=10) as fs:
            home = await fs.realpath(".")
        ```

        The session takes one channel slot through the same admission as `run` (max_sessions,
        the handshake gate, the queue with its deadline, the breaker, the gate `admit`):
        PoolTimeout, PoolFull, HostUnavailable, NotAdmitted, ConnectTimeout, ConnectError as
        there. It waits in `tenant`'s turns
        with that tenant's commands (the API passes the caller's identity, as for its jobs): a
        tenant's backlog of sessions and commands delays another tenant by one turn at most.
        A refused channel is retried like a command's; a connection lost before the session
        started is retried once on a fresh one. In the body, RemoteFileError leaves the slot
        reusable; ConnectionLost(started=True) discards the connection; so does an operation
        cut short (cancelled) where the backend's session says it left the connection unusable
        (`SFTPSession.intact`): ssh2's; asyncssh's and paramiko's keep it. When the body ends
        (whatever way) the session's channel is closed and its slot released.
        """
        if target.nodes:
            async with self._router.sftp(target, acquire_timeout, tenant) as session:
                yield session
            return
        host = await self._host(target)
        t0 = time.perf_counter()
        deadline = None if acquire_timeout is None else host.loop.time() + acquire_timeout
        c, session = await host.open_sftp(deadline, t0, tenant)
        healthy = False
        try:
            yield session
            healthy = True
        except RemoteFileError:
            healthy = True
            raise
        except ConnectionLost:
            host.counters["connections_lost"] += 1
            raise
        except (Exception, asyncio.CancelledError):
            # The caller's own error (a refused path, a client that went away) or its
            # cancellation (a client gone mid-download): the session may be mid-request, but
            # the connection is as good as before, unless the backend says otherwise (intact,
            # below).
            healthy = c.conn.is_alive()
            raise
        finally:
            # Shielded: a cancelled caller still closes the channel and frees the slot. Also
            # asked on a normal exit: a caller may cancel an operation of its own (a read
            # ahead nobody wants any more) and still end the body cleanly.
            healthy = healthy and session.intact()
            await asyncio.shield(host.close_sftp(c, session, healthy))

    async def kill(self, target: Target, pgid: int, node: str | None = None) -> None:
        """Kill a process group on `target` that was started elsewhere (by another process
        sharing the account, e.g. another API replica): TERM, then KILL after a grace period.
        On a cluster, `node` says where it runs (a group id means nothing on another node).
        Raises PoolTimeout, PoolFull, HostUnavailable, ConnectError or TimeoutError."""
        if target.nodes:
            if node not in target.nodes:
                raise ValueError(f"{target}: kill on a cluster needs one of its nodes")
            target = target.node_target(node)
        await (await self._host(target)).kill(pgid)

    async def discard(self, target: Target) -> int:
        """Close `target`'s connections now, with whatever still runs on them (the API revokes
        an identity this way, after killing its commands): its waiters fail with PoolTimeout
        and its next call starts afresh, with a new login. Kills already under way get up to
        KILL_TIMEOUT to finish first. Returns how many connections it closed. A cluster's:
        on every node."""
        if target.nodes:
            closed = [await self.discard(target.node_target(n)) for n in target.nodes]
            return sum(closed)
        host = self._hosts.get(target)
        if host is None:
            return 0
        return await asyncio.shield(host.discard())

    # ---- login-node clusters (sshpool.cluster)

    def drain(self, target: Target, node: str, drained: bool = True) -> None:
        """Stop new work on `node` of `target`'s cluster (its running commands finish, then
        its connections close), or with drained=False take it back. KeyError: no such node."""
        self._router.drain(target, node, drained)

    def probe_with(self, target: Target) -> None:
        """Judge the health of `target`'s cluster's nodes over `target`'s account (the host's
        own service account, never a researcher's): `true` over its pooled connection. Without
        it, a node is probed at its SSH banner (no login)."""
        self._router.probe_with(target)

    async def reprobe(self, target: Target, node: str) -> bool:
        """Probe `node` of `target`'s cluster now: True when it answered (a node down is then
        up again at once). One probe per node at a time: callers asking meanwhile, or within
        a second of its end, share its answer. KeyError: no such node."""
        return await self._router.reprobe(target, node)

    def nodes(self, target: Target) -> dict[str, dict[str, Any]]:
        """Per node of `target`'s cluster: state ("up", "down", "draining", "drained"), why it
        is down, accounts, connections, channels in use and waiters."""
        return self._router.nodes(target)

    def waiting(self, target: Target) -> int:
        """Callers waiting for a slot of `target` (a single node's)."""
        host = self._hosts.get(target)
        return 0 if host is None else len(host.waiters)

    def live(self, target: Target) -> bool:
        """Does `target` (a single node's) hold a live connection?"""
        host = self._hosts.get(target)
        return host is not None and any(c.conn.is_alive() for c in host.conns)

    def may_connect(self, target: Target) -> bool:
        """Would `target`'s breaker let a connect through now?"""
        host = self._hosts.get(target)
        return host is None or host.breaker.may_try(host.loop.time())

    def retire(self, target: Target, retired: bool) -> None:
        """A drained node's pool of one account (`_HostPool.retire`)."""
        host = self._hosts.get(target)
        if host is not None:
            host.retire(retired)

    def stats(self) -> dict[Target, dict[str, Any]]:
        """Per target: connections, channels in use, waiters, handshakes in flight, counters.
        Keyed by the Target itself: two targets that differ only in key or limits stay apart."""
        return {t: h.stats() for t, h in self._hosts.items()}

    def sshd_stats(self) -> dict[str, dict[str, Any]]:
        """Per sshd (``address:port``, shared by every account reaching it): connections busy,
        idle and closing, the most held at once, handshakes in flight and queued (accounts
        waiting for a turn), accounts holding connections, the time accounts waited for a
        grant, evictions and grants (counters). A target with per_sshd=False has its own, keyed
        by the target."""
        return {key: sshd.stats() for key, sshd in self._sshds_in_use().items()}

    def _sshds_in_use(self) -> dict[str, Sshd]:
        return {s.key: s for s in (h.sshd for h in self._hosts.values()) if s.members}

    def __repr__(self) -> str:
        s = list(self.stats().values())
        return (
            f"<Pool backend={self.backend.name} hosts={len(s)} "
            f"connections={sum(h['connections'] for h in s)} "
            f"channels_in_use={sum(h['channels_in_use'] for h in s)} "
            f"waiters={sum(h['waiters'] for h in s)} "
            f"handshakes={sum(h['handshakes_in_flight'] for h in s)}>"
        )

    async def close(self) -> None:
        """Close every connection; idempotent. Shielded so a cancelled caller still closes."""
        if self._closed:
            return
        self._closed = True
        for host in self._hosts.values():
            host.sshd.stopped = True
        await self._router.close()
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        await asyncio.shield(
            asyncio.gather(*(h.close() for h in self._hosts.values()), return_exceptions=True)
        )
