"""The connection pool (`Pool`), the package's face: keeps SSH connections open per Target and
multiplexes commands as channels.

`Pool` maps each Target to its host pool (`sshpool.host.HostPool`, the per-target state machine:
its state changes only in synchronous methods, its I/O outside them), resolves which sshd a
target reaches and shares that sshd's budget among its accounts (`sshpool.budget.Sshd`), runs
the maintenance task, and hands a cluster's targets to `sshpool.cluster.Router`, which depends
on the pool through `sshpool.cluster.NodePools` only. A host pool's connect path (the
handshake, retried after drops, and the executor's start) is `sshpool.connect`'s plain I/O.

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

Invariants of a host pool (`sshpool.host.HostPool` keeps them):
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
import dataclasses
import math
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from typing import Any, cast

from sshpool import tracing
from sshpool.backends import Backend, load_backend
from sshpool.backends.base import SFTPSession
from sshpool.breaker import Penalties
from sshpool.budget import Coordinator, Sshd
from sshpool.cluster import NodeHealth, Router
from sshpool.command import CommandResult, OutputStream, command_line
from sshpool.errors import CommandTimeout, ConnectionLost, RemoteFileError
from sshpool.host import HostPool
from sshpool.lane import Lane, LaneBackend, LaneSFTP
from sshpool.lease import retried
from sshpool.target import Target

# How often the maintenance task prunes dead, idle and expired connections.
MAINTENANCE_INTERVAL = 1.0


async def _resolve(host: str, port: int) -> str:
    """The address a host name resolves to (the first); the name itself when it does not."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return str(infos[0][4][0])
    except (OSError, IndexError):
        return host  # the connect will say what is wrong


class Pool:
    """SSH connections kept open per Target; commands run as channels on them.

    ```python
    async with Pool() as pool:
        result = await pool.run(target, ["echo", "hi"], timeout=10)
    ```
    """

    def __init__(
        self,
        backend: str | Backend = "asyncssh",
        coordinator: Coordinator | None = None,
        health: NodeHealth | None = None,
        lane: Lane | None = None,
    ) -> None:
        self.backend = load_backend(backend) if isinstance(backend, str) else backend
        # Bulk SFTP sessions (`sftp(bulk=True)`) on connections of their own whose I/O runs on
        # the lane's thread (`sshpool.lane`); None: on the command connections, on this loop.
        self.lane = lane
        self._lane_hosts: dict[Target, HostPool] = {}
        self._lane_backends: dict[str, LaneBackend] = {}
        # Shares each sshd's gate and budget with other processes (`sshpool.budget`); None:
        # this process has them all.
        self.coordinator = coordinator
        self._backends: dict[str, Backend] = {self.backend.name: self.backend}
        self._hosts: dict[Target, HostPool] = {}
        # (address, port) -> its budget; host name and port -> the address it resolved to.
        self._sshds: dict[tuple[str, int], Sshd] = {}
        self._addresses: dict[tuple[str, int], asyncio.Future[str]] = {}
        # Callers entering per (host name, port), and the FIFO lock they enter through (`_host`).
        self._entering: Counter[tuple[str, int]] = Counter()
        self._entries: dict[tuple[str, int], asyncio.Lock] = {}
        self._maintenance: asyncio.Task[None] | None = None
        self._closed = False
        # Targets with `nodes` (login-node clusters) are routed to one node's target each;
        # `health` shares their nodes' health with other processes (`sshpool.cluster`).
        self._router = Router(_Nodes(self, self._hosts), health)
        # The application's gate: may `tenant` (what the caller passed) start SSH work on
        # `target` now? Asked before every command and SFTP session starts (the host pool's
        # invariants, sshpool.host); the API refuses a revoked identity or account this way
        # (api/admin/revocations.py).
        self.admit: Callable[[Target, Hashable], bool] = lambda target, tenant: True

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _host(self, target: Target) -> HostPool:
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
            if self._closed:  # closed while this caller waited: its host pool is closed too
                raise RuntimeError("pool is closed")
        if self._maintenance is None:
            self._maintenance = asyncio.create_task(self._maintain())
        return host

    async def _lane_host(self, target: Target) -> HostPool:
        """The host pool of `target`'s transfer connections: made on the lane (channels only,
        whatever the target's exec mode), in the same sshd budget as its command connections
        (a member like another account: counted, gated, evicted alike)."""
        lane = self.lane
        assert lane is not None
        await self._host(target)  # the sshd resolved and the maintenance started, in turn
        host = self._lane_hosts.get(target)
        if host is None:
            name = target.backend or self.backend.name
            backend = self._lane_backends.get(name)
            if backend is None:
                backend = self._lane_backends[name] = LaneBackend(self._backends[name], lane)
            sshd = self._hosts[target].sshd
            host = self._lane_hosts[target] = HostPool(
                dataclasses.replace(target, exec_mode="channel"),
                backend,
                sshd,
                lambda t, tenant: self.admit(target, tenant),
            )
            lim = target.limits
            sshd.join(host, lim.max_handshakes, lim.max_total_connections)
        return host

    async def _new_host(self, target: Target) -> HostPool:
        sshd = await self._sshd(target)
        if self._closed:
            # Closed during the name's lookup: a host pool made now would be none of those the
            # close closed, and its connections would outlive the pool.
            raise RuntimeError("pool is closed")
        name = target.backend or self.backend.name
        if name not in self._backends:
            self._backends[name] = load_backend(name)
        host = self._hosts[target] = HostPool(
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
            for host in [*self._hosts.values(), *self._lane_hosts.values()]:
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

        return await retried(target, attempt)

    @contextlib.asynccontextmanager
    async def sftp(
        self,
        target: Target,
        *,
        acquire_timeout: float | None = None,
        tenant: Hashable = None,
        bulk: bool = False,
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

        `bulk` (a transfer, with a `lane`): the session is on a transfer connection of the
        target's, whose I/O runs on the lane's thread, and its files' reads and writes take
        `tenant`'s turns of the lane (`sshpool.lane`). Same admission, same sshd budget; a
        cluster's sessions stay on its command connections.
        """
        if target.nodes:
            async with self._router.sftp(target, acquire_timeout, tenant) as session:
                yield session
            return
        lane = bulk and self.lane is not None
        host = await (self._lane_host(target) if lane else self._host(target))
        t0 = time.perf_counter()
        deadline = None if acquire_timeout is None else host.loop.time() + acquire_timeout
        c, session = await host.open_sftp(deadline, t0, tenant)
        if isinstance(session, LaneSFTP):
            session.tenant = tenant
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
        with tracing.span("ssh.kill", target):
            await (await self._host(target)).kill(pgid)

    async def discard(self, target: Target) -> int:
        """Close `target`'s connections now, with whatever still runs on them (the API revokes
        an identity this way, after killing its commands): its waiters fail with PoolTimeout
        and its next call starts afresh, with a new login. Kills already under way get up to
        KILL_TIMEOUT to finish first. Returns how many connections it closed (its transfer
        connections on the lane included). A cluster's: on every node."""
        if target.nodes:
            closed = [await self.discard(target.node_target(n)) for n in target.nodes]
            return sum(closed)
        # Its transfer connections on the lane too: a revoked identity's download stops.
        hosts = [h for h in (self._hosts.get(target), self._lane_hosts.get(target)) if h]
        closed = await asyncio.shield(asyncio.gather(*(h.discard() for h in hosts)))
        return sum(closed)

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

    def stats(self) -> dict[Target, dict[str, Any]]:
        """Per target: connections, channels in use, waiters, handshakes in flight, counters.
        Keyed by the Target itself: two targets that differ only in key or limits stay apart."""
        stats = {t: h.stats() for t, h in self._hosts.items()}
        for t, lane in self._lane_hosts.items():
            if t in stats:
                stats[t]["lane"] = lane.stats()
        return stats

    def durations(self) -> dict[Target, dict[str, Any]]:
        """Per target: `create_time` (seconds each connection took to make) and `wait_time`
        (seconds each caller waited for a slot), as `sshpool.durations.Durations` (bucket
        counts, their sum and number, since the pool began), and its `max_connections`."""
        return {
            t: {
                "create_time": h.create_time,
                "wait_time": h.wait_time,
                "max_connections": h.limits.max_connections,
            }
            for t, h in self._hosts.items()
        }

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
        hosts = [*self._lane_hosts.values(), *self._hosts.values()]
        for host in hosts:
            host.sshd.stopped = True
        await self._router.close()
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        await asyncio.shield(asyncio.gather(*(h.close() for h in hosts), return_exceptions=True))


class _Nodes:
    """The pool as the cluster router sees it (`sshpool.cluster.NodePools`): commands and SFTP
    sessions on one node's target, and the state of that target's host pool."""

    def __init__(self, pool: Pool, hosts: dict[Target, HostPool]) -> None:
        self.pool = pool
        self.hosts = hosts

    def run(self, target: Target, *args: Any, **kw: Any) -> Awaitable[CommandResult]:
        return self.pool.run(target, *args, **kw)

    def sftp(
        self, target: Target, *, acquire_timeout: float | None, tenant: Hashable
    ) -> contextlib.AbstractAsyncContextManager[SFTPSession]:
        return self.pool.sftp(target, acquire_timeout=acquire_timeout, tenant=tenant)

    def stats(self) -> dict[Target, dict[str, Any]]:
        return self.pool.stats()

    def waiting(self, target: Target) -> int:
        """Callers waiting for a slot of `target` (a single node's)."""
        host = self.hosts.get(target)
        return 0 if host is None else len(host.waiters)

    def live(self, target: Target) -> bool:
        """Does `target` (a single node's) hold a live connection?"""
        host = self.hosts.get(target)
        return host is not None and any(c.conn.is_alive() for c in host.conns)

    def may_connect(self, target: Target) -> bool:
        """Would `target`'s breaker let a connect through now?"""
        host = self.hosts.get(target)
        return host is None or host.breaker.may_try(host.loop.time())

    def retire(self, target: Target, retired: bool) -> None:
        """A drained node's pool of one account (`HostPool.retire`)."""
        host = self.hosts.get(target)
        if host is not None:
            host.retire(retired)
