"""The connect path as plain I/O (`connect`): the handshake, retried after sshd drops it (paced,
while callers still wait for it), and the executor's start on a new connection (agent mode).

Nothing here keeps a host pool's state: the host pool (`sshpool.host.HostPool`) counts its
connects, decides what a failure means for its breaker and waiters, and turns itself to
channel mode when a host has no usable python3; these functions only do the I/O and say how it
went (a connection, or the error).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sshpool.agent import AgentConnection, start_agent
from sshpool.backends import Backend, Connection
from sshpool.errors import AgentUnavailable, ConnectError, ConnectionLost, SSHPoolError
from sshpool.target import Target

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


@dataclass(frozen=True, slots=True)
class Connected:
    """What `connect` made: the connection (its executor's in agent mode) and the commands it
    may run at once; `no_agent`, why the executor could not start (the host has no usable
    python3: the host pool turns to channel mode)."""

    conn: Connection
    slots: int
    no_agent: str | None = None


async def connect(
    backend: Backend,
    target: Target,
    agent: Callable[[], bool],
    wanted: Callable[[], bool],
    counters: Counter[str],
) -> Connected:
    """One new connection to `target`: the handshake (`handshake`, retried while `wanted()`),
    then, while `agent()` (the host pool is in agent mode), its executor (`start_executor`,
    counted in `counters["agents_started"]`). A host without a usable python3 gives the
    connection as it is, for channels, with the reason; a connection lost meanwhile is a failed
    connect."""
    conn = await handshake(backend, target, wanted, counters)
    if not agent():
        return Connected(conn, target.limits.max_sessions)
    try:
        executor = await start_executor(conn, target)
    except AgentUnavailable as exc:
        return Connected(conn, target.limits.max_sessions, str(exc))
    counters["agents_started"] += 1
    return Connected(executor, target.limits.agent_max_commands)
