"""The connect path as plain I/O (`connect`): the handshake, retried after sshd drops it (paced,
while callers still wait for it), and the executor's start on a new connection (agent mode).

The host pool (`sshpool.host.HostPool`) keeps its own state: it counts its connects and
decides what a failure means for its breaker and waiters. The one state kept here is a host
pool's agent mode (`AgentMode`), which the executor's start alone changes, in synchronous
methods like the host pool's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable

from sshpool.agent import AgentConnection, start_agent
from sshpool.backends import Backend, Connection
from sshpool.errors import AgentUnavailable, ConnectError, ConnectionLost, SSHPoolError
from sshpool.target import Target
from sshpool.tracing import Stages, stamping

log = logging.getLogger("sshpool")

# The pause before retrying a handshake sshd dropped: doubles from the first to the cap, with
# jitter, while the attempt keeps its place in the handshake gate (so the gate slows down too).
DROP_PAUSE = 0.1
DROP_PAUSE_MAX = 2.0
# Dropped handshakes that failed a connect are logged once per this many seconds, all pools and
# accounts together: a storm drops thousands, and one line per drop buries everything else.
DROP_LOG_EVERY = 5.0


class Throttle:
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


drop_log = Throttle(DROP_LOG_EVERY)


async def handshake(
    backend: Backend, target: Target, wanted: Callable[[], bool], counters: Counter[str]
) -> Connection:
    """backend.connect, again after a drop (a reset before the banner: sshd shedding load,
    MaxStartups) while `wanted()` (callers still wait for it), paced; per_sshd=False: once.
    Each retry counts in `counters["connect_retries"]`."""
    drops = 0
    while True:
        try:
            return await backend.connect(target)
        except ConnectError as exc:
            drops += 1
            if not exc.retryable or (drops > 1 and not (target.limits.per_sshd and wanted())):
                raise
            counters["connect_retries"] += 1
            pause = min(DROP_PAUSE * 2 ** (drops - 1), DROP_PAUSE_MAX)
            await asyncio.sleep(random.uniform(pause / 2, pause))


def log_connect_failure(target: Target, exc: SSHPoolError) -> None:
    """One line per failed connect, but drops (sshd shedding load) once per DROP_LOG_EVERY
    over all pools, with the count of those held back."""
    if not (isinstance(exc, ConnectError) and exc.retryable):
        log.warning("connect to %s failed: %s", target, exc)
        return
    held = drop_log.allow()
    if held is not None:
        more = f" ({held} more dropped handshakes not logged)" if held else ""
        log.warning("connect to %s failed: %s%s", target, exc, more)


async def start_executor(conn: Connection, target: Target) -> AgentConnection:
    """`conn` with its executor started (agent mode), for limits.agent_max_commands commands
    at once. AgentUnavailable: the host has no usable python3, and `conn` is left open as it
    was (usable in channel mode); a connection lost meanwhile is ConnectionLost(started=False)
    and any other failure is raised as it is, `conn` closed either way."""
    try:
        # Two more for the executor than the pool leases: kills of timed-out commands.
        agent = await start_agent(
            conn,
            target.limits.agent_max_commands + 2,
            python=target.agent_python,
            timeout=target.limits.agent_start_timeout,
        )
    except AgentUnavailable as exc:
        if not conn.is_alive():
            await conn.close()
            raise ConnectionLost(str(exc), started=False) from None
        raise
    except BaseException:
        await conn.close()
        raise
    if agent.preamble:
        log.warning(
            "the login printed %d bytes before the executor started (not output): %r",
            len(agent.preamble),
            agent.preamble[:200],
        )
    return agent


class AgentMode:
    """A host pool's agent mode: on (Target.exec_mode "agent") until a connection finds no
    usable python3, then off for good (`error` says why); `exposed`, why its executors could
    not make themselves undumpable, once seen. Each is logged once."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.on = target.exec_mode == "agent"
        self.error: str | None = None
        self.exposed: str | None = None

    def unavailable(self, exc: AgentUnavailable) -> None:
        if self.on:
            self.on, self.error = False, str(exc)
            log.warning("%s: %s; this host's commands run as channels instead", self.target, exc)

    def started(self, agent: AgentConnection) -> None:
        exposed = agent.hello.get("exposed")
        if exposed and self.exposed is None:
            self.exposed = str(exposed)[:300]
            log.warning(
                "%s: the executor could not make itself undumpable (%s): commands of this "
                "account can open its channel through /proc",
                self.target,
                self.exposed,
            )


async def connect(
    backend: Backend,
    target: Target,
    agent: AgentMode,
    wanted: Callable[[], bool],
    counters: Counter[str],
) -> tuple[Connection, int, Stages]:
    """One new connection to `target`, the commands it may run at once, and the stamps of its
    stages (`sshpool.tracing.Stages`: the commands that waited for it trace them): the handshake
    (`handshake`, retried while `wanted()`), then, while `agent` is on, its executor
    (`start_executor`, counted in `counters["agents_started"]`). A host without a usable
    python3 turns `agent` off and gives the connection as it is, for channels; a connection
    lost meanwhile is a failed connect. A failed connect's error carries its stamps (`stages`)."""
    stamps = Stages()
    try:
        with stamping(stamps):
            conn = await handshake(backend, target, wanted, counters)
        if not agent.on:
            return conn, target.limits.max_sessions, stamps
        began = time.time_ns()
        try:
            executor = await start_executor(conn, target)
        except AgentUnavailable as exc:
            agent.unavailable(exc)
            return conn, target.limits.max_sessions, stamps
        stamps.mark("executor_start", began)
        agent.started(executor)
        counters["agents_started"] += 1
        return executor, target.limits.agent_max_commands, stamps
    except SSHPoolError as exc:
        exc.stages = stamps
        raise
    finally:
        stamps.end = time.time_ns()
