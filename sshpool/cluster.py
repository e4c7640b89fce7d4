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
- a node is down from the failure that showed it (a connect failure, or a connection lost
  while a probe could not reach it) until a probe succeeds; one probe per node at a time, over
  a pooled connection of an account that uses the node (`true`, every `probe_interval` while
  the node is up and in use; while it is down, as often as that account's breaker lets a
  connect through): never a probe per account or per command;
- a command that had not started (waiting for a connection or a channel) when its node failed
  moves to another node within its deadline; one that had started ends `NodeFailed` (its
  outcome is unknown: never re-run);
- a drained node takes no new work; its running commands end as they would, and each of its
  connections closes when its last channel ends.

State changes only in the synchronous methods of `Cluster`; the `Router` does the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sshpool.backends.base import SFTPSession
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
from sshpool.target import Target

if TYPE_CHECKING:
    from sshpool.pool import Pool

log = logging.getLogger("sshpool.cluster")

T = TypeVar("T")
NodeState = Literal["up", "down", "draining", "drained"]

# How often the prober looks at the nodes (it starts a probe only when one is due).
PROBE_TICK = 0.5
# How long one probe may take (queue, connect and `true` together).
PROBE_TIMEOUT = 5.0
# The probe's tenant: its own turn on a busy node, never behind a backlog.
PROBE_TENANT = ("sshpool", "probe")


def rank(nodes: list[str], account: str) -> list[str]:
    """`nodes` in `account`'s rendezvous order: highest hash of (node, account) first."""

    def score(node: str) -> bytes:
        return hashlib.blake2b(f"{node}\0{account}".encode(), digest_size=8).digest()

    return sorted(nodes, key=score, reverse=True)


def account_key(target: Target) -> str:
    """What an account is, for routing: its user name on the cluster."""
    return target.username


@dataclass(slots=True)
class Node:
    name: str
    down: bool = False
    drained: bool = False
    why_down: str = ""
    # Node targets of the accounts that used this node, oldest first (probes and drains).
    members: dict[Target, None] = field(default_factory=dict)
    # The account that last failed here: the probe of a down node goes through its pool.
    probe_target: Target | None = None
    last_probe: float = 0.0
    probe: asyncio.Future[bool] | None = None
    # routed (work sent here), spilled (of it, from a longer queue at the account's home),
    # failovers (work that failed here before it started and moved on), downs, probes,
    # probes_failed: what an operator reads per node (api/metrics.py).
    counters: Counter[str] = field(default_factory=Counter)


class Cluster:
    """The nodes of one cluster (its node list and port) and their health and drain state."""

    def __init__(self, nodes: tuple[str, ...]) -> None:
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

    def mark_down(self, name: str, target: Target, why: str) -> None:
        node = self.nodes[name]
        node.probe_target = target
        if not node.down:
            node.down, node.why_down = True, why
            node.counters["downs"] += 1
            log.warning("login node %s is down (%s): its new work goes to the others", name, why)

    def mark_up(self, name: str) -> None:
        node = self.nodes[name]
        if node.down:
            node.down, node.why_down = False, ""
            log.warning("login node %s is up again", name)

    def state(self, name: str, live: bool) -> NodeState:
        node = self.nodes[name]
        if node.drained:
            return "draining" if live else "drained"
        return "down" if node.down else "up"


class Router:
    """Runs a cluster target's commands and SFTP sessions on its nodes (module docstring)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.clusters: dict[tuple[tuple[str, ...], int], Cluster] = {}
        self._prober: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def cluster(self, target: Target) -> Cluster:
        key = (target.nodes, target.port)
        cluster = self.clusters.get(key)
        if cluster is None:
            cluster = self.clusters[key] = Cluster(target.nodes)
        if self._prober is None:
            self._prober = asyncio.create_task(self._probe_loop())
        return cluster

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
            except (ConnectError, ConnectTimeout) as exc:
                cluster.mark_down(node, nt, f"{type(exc).__name__}: {exc}")
                failed: SSHPoolError = exc
            except ConnectionLost as exc:
                if exc.started:
                    raise
                cluster.mark_down(node, nt, f"connection lost: {exc}")
                failed = exc
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
            def started(pgid: int) -> None:
                if on_node is not None:
                    on_node(node)
                if on_started is not None:
                    on_started(pgid)

            try:
                return await self.pool.run(nt, acquire_timeout=left, on_started=started, **kw)
            except ConnectionLost as exc:
                if not exc.started or not await self.node_failed(cluster, node, nt):
                    raise
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
        """After a started command lost its connection: is its node down? One probe answers
        every command lost there at once."""
        cluster.nodes[node].probe_target = nt
        return not await self._probe(cluster, node)

    # ---- probes

    def _probe(self, cluster: Cluster, name: str) -> asyncio.Future[bool]:
        """The node's probe under way, or a new one: True when the node answered."""
        node = cluster.nodes[name]
        if node.probe is None or node.probe.done():
            node.probe = asyncio.ensure_future(self._probe_once(cluster, name))
            self._tasks.add(node.probe)
            node.probe.add_done_callback(self._tasks.discard)
        return node.probe

    async def _probe_once(self, cluster: Cluster, name: str) -> bool:
        node = cluster.nodes[name]
        node.last_probe = asyncio.get_running_loop().time()
        target = node.probe_target if node.down else self._in_use(node)
        if target is None:
            target = node.probe_target or next(iter(node.members), None)
        if target is None:
            return not node.down
        node.counters["probes"] += 1
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                await self.pool.run(
                    target, ["true"], timeout=PROBE_TIMEOUT, tenant=PROBE_TENANT, gated=False
                )
        except (HostUnavailable, PoolTimeout, PoolFull):
            return not node.down  # nothing tried (breaker open) or a busy node: as it was
        except (AuthenticationFailed, HostKeyMismatch):
            return not node.down
        except (ConnectError, ConnectTimeout, ConnectionLost, CommandTimeout, TimeoutError) as exc:
            node.counters["probes_failed"] += 1
            cluster.mark_down(name, target, f"probe: {type(exc).__name__}: {exc}")
            return False
        cluster.mark_up(name)
        return True

    def _in_use(self, node: Node) -> Target | None:
        """An account's target with a live connection to the node, if any (probe over it)."""
        return next((t for t in node.members if self.pool.live(t)), None)

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PROBE_TICK)
            now = loop.time()
            for cluster in list(self.clusters.values()):
                for node in cluster.nodes.values():
                    if node.drained or (node.probe is not None and not node.probe.done()):
                        continue
                    if node.down and node.probe_target is not None:
                        if self.pool.may_connect(node.probe_target):
                            self._probe(cluster, node.name)
                    elif not node.down and node.members:
                        interval = next(iter(node.members)).limits.probe_interval
                        if now - node.last_probe >= interval and self._in_use(node):
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
