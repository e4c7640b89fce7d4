"""Login-node clusters: one host, several login nodes, each node with pools of its own.

A Target with `nodes` names a cluster (docs/pool.md, "Login-node clusters"). The pool hands its
commands and SFTP sessions to the `Router` here, which picks a node and runs them there as that
node's own target (`Target.node_target`): each node keeps its own pools, breaker and sshd
budget (`sshpool.budget`), exactly as a single host.

Invariants of a cluster:
- an account's work goes to its home node: the first of its nodes ranked by rendezvous hashing
  (highest hash of node and account) among the nodes that are up and not drained, so losing or
  adding a node moves only the accounts whose first node it is (a quarter of them, adding a
  fourth node to three);
- spill: while the home node's queue for the account holds `spill_waiters` callers or more,
  a command goes to the next node in the account's ranking with a shorter queue;
- a node's health is judged only by its probe, never from a researcher's account: over the
  host's own service account when one is registered (`Pool.probe_with`: `true` over its
  pooled connection), otherwise at the SSH banner (a TCP connect that reads ``SSH-2.0-``, no
  login). An account's failure on a node (a connect or handshake failure, a connection lost
  before or while its command ran) only asks for a probe; whatever happens after a login is
  that account's own (its login shell, its files) and never takes the node down for others;
- a node is down from the probe that failed until the first probe that succeeds; one probe
  per node at a time (callers asking meanwhile share its answer): every `probe_interval`
  while the node is up and in use, every PROBE_TICK while it is down (at the banner while
  the service account's breaker there lets no connect through), and when an admin asks
  (`Pool.reprobe`, answered from the last probe when it ended less than REPROBE_SPACING ago);
- a command that had not started (waiting for a connection or a channel, or on a channel
  that had not reported its start yet: no marker line, no STARTED) when its node failed moves
  to another node within its deadline; one that had reported its start ends `NodeFailed`
  (its outcome is unknown: never re-run);
- a drained node takes no new work; its running commands end as they would, and each of its
  connections closes when its last channel ends;
- shared with other processes (`NodeHealth`, docs/pool.md "Many processes, one sshd"): a node
  this process's probe takes down or brings back is published; a node another process
  reports down is out of routing here at once and probed here like any node down; a node
  another reports up is probed here now, and comes back here only on this process's own
  probe (never on another's word), one that started after the node was reported down.

State changes only in the synchronous methods of `Cluster`; the `Router` does the I/O, through
what it needs of the pool (`NodePools`, which `sshpool.pool.Pool` hands it), never the pool
itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from sshpool.backends.base import SFTPSession
from sshpool.backends.translate import describe
from sshpool.command import CommandResult
from sshpool.errors import (
    AuthenticationFailed,
    CommandTimeout,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HostKeyMismatch,
    HostUnavailable,
    NodeFailed,
    PoolFull,
    PoolTimeout,
    SSHPoolError,
)
from sshpool.target import Target, split_node

log = logging.getLogger("sshpool.cluster")

T = TypeVar("T")
NodeState = Literal["up", "down", "draining", "drained"]

# How often the prober looks at the nodes (it starts a probe only when one is due).
PROBE_TICK = 0.5
# How long one probe may take (queue, connect and `true` together).
PROBE_TIMEOUT = 5.0
# The probe's tenant: its own turn on a busy node, never behind a backlog.
PROBE_TENANT = ("sshpool", "probe")
# An admin's re-probe within this long of the last probe's end gets that probe's answer.
REPROBE_SPACING = 1.0
# The most a banner probe reads before the SSH identification line (RFC 4253 allows lines
# before it; sshd sends none).
BANNER_MAX = 8192


def rank(nodes: list[str], account: str) -> list[str]:
    """`nodes` in `account`'s rendezvous order: highest hash of (node, account) first."""

    def score(node: str) -> bytes:
        return hashlib.blake2b(f"{node}\0{account}".encode(), digest_size=8).digest()

    return sorted(nodes, key=score, reverse=True)


def _why(exc: OSError) -> str:
    """A socket error as a probe reports it ("connection refused", not asyncio's wording)."""
    return os.strerror(exc.errno).lower() if exc.errno else describe(exc)


def account_key(target: Target) -> str:
    """What an account is, for routing: its user name on the cluster."""
    return target.username


class NodePools(Protocol):
    """What the router needs of the pool: `Pool.run`, `Pool.sftp` and `Pool.stats` on one node's
    target (`Target.node_target`), and the state of that target's host pool."""

    def run(self, target: Target, *args: Any, **kw: Any) -> Awaitable[CommandResult]:
        """`Pool.run` on `target`."""
        ...

    def sftp(
        self, target: Target, *, acquire_timeout: float | None, tenant: Hashable
    ) -> contextlib.AbstractAsyncContextManager[SFTPSession]:
        """`Pool.sftp` on `target`."""
        ...

    def stats(self) -> dict[Target, dict[str, Any]]:
        """`Pool.stats`."""
        ...

    def waiting(self, target: Target) -> int:
        """Callers waiting for a slot of `target`."""
        ...

    def live(self, target: Target) -> bool:
        """Does `target` hold a live connection?"""
        ...

    def may_connect(self, target: Target) -> bool:
        """Would `target`'s breaker let a connect through now?"""
        ...

    def retire(self, target: Target, retired: bool) -> None:
        """Take `target`'s pool out of service (a drained node: `HostPool.retire`) or back."""
        ...


class NodeHealth(Protocol):
    """How the processes routing to one cluster share its nodes' health (the Redis side:
    api/node_health.py). `publish` is synchronous and cheap (no I/O); the other processes'
    verdicts come back through `Router.heard`. A node is named by `host:port`
    (`Router.address`)."""

    def attach(self, router: Router) -> None:
        """The router whose verdicts go out and to which the others' come."""
        ...

    def publish(self, node: str, down: bool, why: str) -> None:
        """This process's probe took `node` down (`why`) or brought it back."""
        ...


@dataclass(slots=True)
class Node:
    name: str
    down: bool = False
    drained: bool = False
    why_down: str = ""
    # Node targets of the accounts that used this node, oldest first (drains, "in use").
    members: dict[Target, None] = field(default_factory=dict)
    # When the last probe started and ended (loop time).
    last_probe: float = 0.0
    probe_ended: float = 0.0
    probe: asyncio.Future[bool] | None = None
    # When another process last reported it down (loop time): a probe that started before
    # says nothing of it.
    heard_down: float = 0.0
    # routed (work sent here), spilled (of it, from a longer queue at the account's home),
    # failovers (work that failed here before it started and moved on), downs, probes,
    # probes_failed: what an operator reads per node (api/metrics.py).
    counters: Counter[str] = field(default_factory=Counter)


class Cluster:
    """The nodes of one cluster (its node list and port) and their health and drain state."""

    def __init__(self, nodes: tuple[str, ...], port: int = 22) -> None:
        # What the Router keys it by: its node list and the port of nodes without one.
        self.key = (nodes, port)
        self.nodes = {name: Node(name) for name in nodes}
        # no_node: work refused because no node was up and not drained.
        self.counters: Counter[str] = Counter()

    def candidates(self) -> list[str]:
        return [n.name for n in self.nodes.values() if not n.down and not n.drained]

    # ---- state changes: synchronous, no awaits ----

    def pick(
        self, account: str, exclude: set[str], queue: Callable[[str], int], spill: int
    ) -> str | None:
        """The node for one command of `account`: its home among the nodes up and not drained,
        or the next with a shorter queue while the home's is `spill` long; None: no node."""
        order = [n for n in rank(self.candidates(), account) if n not in exclude]
        if not order:
            return None
        home = order[0]
        waiting = queue(home)
        best = min(order, key=queue) if waiting >= spill else home
        if queue(best) < waiting:
            self.nodes[best].counters["spilled"] += 1
        else:
            best = home
        self.nodes[best].counters["routed"] += 1
        return best

    def mark_down(self, name: str, why: str) -> bool:
        """True when the node was up."""
        node = self.nodes[name]
        if node.down:
            return False
        node.down, node.why_down = True, why
        node.counters["downs"] += 1
        log.warning("login node %s is down (%s): its new work goes to the others", name, why)
        return True

    def mark_up(self, name: str) -> bool:
        """True when the node was down."""
        node = self.nodes[name]
        if not node.down:
            return False
        node.down, node.why_down = False, ""
        log.warning("login node %s is up again", name)
        return True

    def state(self, name: str, live: bool) -> NodeState:
        node = self.nodes[name]
        if node.drained:
            return "draining" if live else "drained"
        return "down" if node.down else "up"


class Router:
    """Runs a cluster target's commands and SFTP sessions on its nodes (module docstring)."""

    def __init__(self, pool: NodePools, health: NodeHealth | None = None) -> None:
        self.pool = pool
        # Shares the nodes' health with other processes; None: this process judges alone.
        self.health = health
        if health is not None:
            health.attach(self)
        self.clusters: dict[tuple[tuple[str, ...], int], Cluster] = {}
        # Per cluster, the service account its nodes are probed over (`probe_with`).
        self.probers: dict[tuple[tuple[str, ...], int], Target] = {}
        self._prober: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def cluster(self, target: Target) -> Cluster:
        key = (target.nodes, target.port)
        cluster = self.clusters.get(key)
        if cluster is None:
            cluster = self.clusters[key] = Cluster(*key)
        if self._prober is None:
            self._prober = asyncio.create_task(self._probe_loop())
        return cluster

    @staticmethod
    def address(cluster: Cluster, name: str) -> str:
        """Node `name` of `cluster` as the processes name it to each other: `host:port`."""
        host, port = split_node(name, cluster.key[1])
        return f"{host}:{port}"

    def watched(self) -> set[str]:
        """Every node of every cluster this process routes to (`address`)."""
        return {self.address(c, name) for c in self.clusters.values() for name in c.nodes}

    def heard(self, node: str, down: bool, why: str) -> None:
        """Another process's probe took `node` (`address`) down, or brought it back. Down: out
        of routing here at once, and probed here every PROBE_TICK like any node down. Up: a
        probe here now; the node comes back here only when it answers."""
        now = asyncio.get_running_loop().time()
        for cluster in list(self.clusters.values()):
            for name, state in cluster.nodes.items():
                if self.address(cluster, name) != node:
                    continue
                if down:
                    state.heard_down = now
                    if cluster.mark_down(name, f"another process: {why}"):
                        state.counters["downs_heard"] += 1
                elif state.down and not state.drained:
                    self._probe(cluster, name)

    def _node_target(self, cluster: Cluster, target: Target, node: str) -> Target:
        nt = target.node_target(node)
        cluster.nodes[node].members.setdefault(nt, None)
        return nt

    async def routed(
        self,
        target: Target,
        acquire_timeout: float | None,
        attempt: Callable[[str, Target, float | None], Awaitable[T]],
        *,
        pinned: bool = False,
    ) -> T:
        """`attempt(node, node_target, acquire_timeout)` on the account's node, then on the
        next ones while it fails before anything ran there, within `acquire_timeout` in all.
        `pinned`: the account's first node of all, healthy or not (files not shared)."""
        cluster = self.cluster(target)
        loop = asyncio.get_running_loop()
        deadline = None if acquire_timeout is None else loop.time() + acquire_timeout
        account = account_key(target)
        tried: set[str] = set()
        spill = target.limits.spill_waiters

        def queue(node: str) -> int:
            return self.pool.waiting(target.node_target(node))

        while True:
            if pinned:
                first = rank(list(cluster.nodes), account)[0]
                node: str | None = None if first in tried or cluster.nodes[first].drained else first
                if node is not None:
                    cluster.nodes[node].counters["routed"] += 1
            else:
                node = cluster.pick(account, tried, queue, spill)
            if node is None:
                cluster.counters["no_node"] += 1
                raise HostUnavailable(f"{target}: no login node is up", 1.0)
            nt = self._node_target(cluster, target, node)
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                return await attempt(node, nt, left)
            except (AuthenticationFailed, HostKeyMismatch):
                raise  # the account's or the site's to fix: not a node failure to hide
            except (ConnectError, ConnectTimeout, ConnectionLost) as exc:
                if isinstance(exc, ConnectionLost) and exc.started:
                    raise
                # Nothing ran: it moves on, and the node's own probe says whether it is down
                # (this account's failure alone never takes it down for the others).
                if not cluster.nodes[node].down:
                    self._probe(cluster, node)
                failed: SSHPoolError = exc
            except (HostUnavailable, PoolFull) as exc:
                failed = exc  # this account's breaker or queue there: the node may be fine
            tried.add(node)
            cluster.nodes[node].counters["failovers"] += 1
            if deadline is not None and loop.time() >= deadline:
                raise failed

    async def run(self, target: Target, acquire_timeout: float | None, **kw: Any) -> Any:
        """Pool.run on a cluster: `kw` are Pool.run's own, plus `on_node(node)` (called as the
        command starts, before `on_started`)."""
        on_node: Callable[[str], None] | None = kw.pop("on_node", None)
        on_started: Callable[[int], None] | None = kw.pop("on_started", None)
        cluster = self.cluster(target)

        async def attempt(node: str, nt: Target, left: float | None) -> Any:
            reported = False

            def started(pgid: int) -> None:
                nonlocal reported
                reported = True
                if on_node is not None:
                    on_node(node)
                if on_started is not None:
                    on_started(pgid)

            try:
                return await self.pool.run(nt, acquire_timeout=left, on_started=started, **kw)
            except ConnectionLost as exc:
                if not exc.started or not await self.node_failed(cluster, node, nt):
                    raise
                if not reported:
                    # Its node failed before the command reported its start (the marker line,
                    # the executor's STARTED): it moves on as work that never started.
                    raise ConnectionLost(str(exc), started=False) from exc
                lost = NodeFailed(
                    f"{target}: login node {node} failed while the command ran there", node
                )
                lost.remote_pgid = exc.remote_pgid
                lost.remote_killed = exc.remote_killed
                raise lost from exc

        return await self.routed(target, acquire_timeout, attempt)

    @contextlib.asynccontextmanager
    async def sftp(
        self, target: Target, acquire_timeout: float | None, tenant: Any
    ) -> AsyncIterator[SFTPSession]:
        """Pool.sftp on a cluster: the session opens on the account's node (failing over as a
        command's does); `shared_files=False` pins it to one node."""

        async def attempt(node: str, nt: Target, left: float | None) -> Any:
            ctx = self.pool.sftp(nt, acquire_timeout=left, tenant=tenant)
            return ctx, await ctx.__aenter__()

        ctx, session = await self.routed(
            target, acquire_timeout, attempt, pinned=not target.shared_files
        )
        try:
            yield session
        except BaseException as exc:
            if not await ctx.__aexit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            await ctx.__aexit__(None, None, None)

    async def node_failed(self, cluster: Cluster, node: str, nt: Target) -> bool:
        """After a started command lost its connection: is its node down? Its probe answers
        (one for every command lost there at once), never the account that lost it."""
        return not await self._probe(cluster, node)

    # ---- probes

    def probe_with(self, target: Target) -> None:
        """Probe the nodes of `target`'s cluster over `target`'s account (the host's own
        service account: `true` over its pooled connection) instead of at the SSH banner."""
        self.cluster(target)
        self.probers[(target.nodes, target.port)] = target

    async def reprobe(self, target: Target, node: str) -> bool:
        """Probe `node` of `target`'s cluster now (the probe under way, or the last one's
        answer when it ended less than REPROBE_SPACING ago): True when it answered. A node
        down comes back at once when it did. KeyError: no such node."""
        cluster = self.cluster(target)
        if node not in cluster.nodes:
            raise KeyError(node)
        last = cluster.nodes[node].probe
        now = asyncio.get_running_loop().time()
        if (
            last is not None
            and last.done()
            and now - cluster.nodes[node].probe_ended < (REPROBE_SPACING)
        ):
            return last.result()
        return await self._probe(cluster, node)

    def _probe(self, cluster: Cluster, name: str) -> asyncio.Future[bool]:
        """The node's probe under way, or a new one: True when the node answered."""
        node = cluster.nodes[name]
        if node.probe is None or node.probe.done():
            node.probe = asyncio.ensure_future(self._probe_once(cluster, name))
            self._tasks.add(node.probe)
            node.probe.add_done_callback(self._tasks.discard)
        return node.probe

    def _service(self, cluster: Cluster, name: str) -> Target | None:
        """The service account's target on node `name`, when one is registered."""
        service = self.probers.get(cluster.key)
        return None if service is None else service.node_target(name)

    async def _probe_once(self, cluster: Cluster, name: str) -> bool:
        node = cluster.nodes[name]
        loop = asyncio.get_running_loop()
        started = node.last_probe = loop.time()
        node.counters["probes"] += 1
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                await self._ask(cluster, name)
        except (PoolTimeout, PoolFull):
            return not node.down  # a busy node: as it was
        except (AuthenticationFailed, HostKeyMismatch) as exc:
            # The node's sshd answered; the service account's login is the site's to fix.
            log.warning("probe of login node %s: %s", name, exc)
            return not node.down
        except (ConnectError, ConnectTimeout, ConnectionLost, CommandTimeout, TimeoutError) as exc:
            node.counters["probes_failed"] += 1
            why = f"probe: {type(exc).__name__}: {exc}"
            if cluster.mark_down(name, why) and self.health is not None:
                self.health.publish(self.address(cluster, name), True, why)
            return False
        except SSHPoolError as exc:
            # Anything else (the executor refused `true`): the node answered; as it was.
            log.warning("probe of login node %s: %s", name, exc)
            return not node.down
        finally:
            node.probe_ended = loop.time()
        if node.heard_down > started:
            return not node.down  # reported down while it ran: the next probe says
        if cluster.mark_up(name) and self.health is not None:
            self.health.publish(self.address(cluster, name), False, "")
        return True

    async def _ask(self, cluster: Cluster, name: str) -> None:
        """One probe: `true` over the service account, or the SSH banner without one or while
        the service account's breaker there lets no connect through."""
        service = self._service(cluster, name)
        if service is not None and (self.pool.live(service) or self.pool.may_connect(service)):
            try:
                await self.pool.run(
                    service, ["true"], timeout=PROBE_TIMEOUT, tenant=PROBE_TENANT, gated=False
                )
                return
            except HostUnavailable:
                pass  # its breaker opened meanwhile: the banner says
        await self._banner(cluster, name)

    async def _banner(self, cluster: Cluster, name: str) -> None:
        """The node's sshd sends its identification line (``SSH-2.0-...``): no login. Raises
        ConnectError (refused, closed, not SSH) or TimeoutError."""
        host, port = split_node(name, cluster.key[1])
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            raise ConnectError(f"{host}:{port}: {_why(exc)}") from None
        try:
            seen = 0
            while seen < BANNER_MAX:
                line = await reader.readline()
                if not line:
                    raise ConnectError(f"{host}:{port}: closed before the SSH banner")
                if line.startswith((b"SSH-2.0-", b"SSH-1.99-")):
                    return
                seen += len(line)
            raise ConnectError(f"{host}:{port}: no SSH banner")
        except OSError as exc:
            raise ConnectError(f"{host}:{port}: {_why(exc)}") from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _in_use(self, node: Node) -> bool:
        """Does an account hold a live connection to the node?"""
        return any(self.pool.live(t) for t in node.members)

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PROBE_TICK)
            now = loop.time()
            for cluster in list(self.clusters.values()):
                service = self.probers.get(cluster.key)
                for node in cluster.nodes.values():
                    if node.drained or (node.probe is not None and not node.probe.done()):
                        continue
                    if node.down:
                        self._probe(cluster, node.name)
                    elif node.members and self._in_use(node):
                        limits = (service or next(iter(node.members))).limits
                        if now - node.last_probe >= limits.probe_interval:
                            self._probe(cluster, node.name)

    # ---- drain

    def drain(self, target: Target, node: str, drained: bool = True) -> None:
        """Take `node` out of the cluster's routing (drained) or put it back. Draining closes
        each of its connections once its last channel ends; waiters there move on."""
        cluster = self.cluster(target)
        if node not in cluster.nodes:
            raise KeyError(node)
        cluster.nodes[node].drained = drained
        for nt in cluster.nodes[node].members:
            self.pool.retire(nt, drained)

    def nodes(self, target: Target) -> dict[str, dict[str, Any]]:
        """Per node of `target`'s cluster: its state (up, down, draining, drained), why it is
        down, its connections, channels in use and waiters over every account, whether any
        account's breaker there is not closed, and the node's counters (`Node.counters`)."""
        cluster = self.cluster(target)
        stats = self.pool.stats()
        out: dict[str, dict[str, Any]] = {}
        for name, node in cluster.nodes.items():
            pools = [stats[t] for t in node.members if t in stats]
            connections = sum(p["connections"] for p in pools)
            out[name] = {
                "state": cluster.state(name, connections > 0),
                "why_down": node.why_down or None,
                "accounts": len(pools),
                "connections": connections,
                "channels_in_use": sum(p["channels_in_use"] for p in pools),
                "waiters": sum(p["waiters"] for p in pools),
                "breaker_open": any(p["breaker"] != "closed" for p in pools),
                "counters": dict(node.counters),
            }
        return out

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._prober] if self._prober else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
