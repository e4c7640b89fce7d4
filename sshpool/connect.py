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


async def start_executor(conn: Connection, target: Target, timeout: float) -> AgentConnection:
    """`conn` with its executor started (agent mode), for limits.agent_max_commands commands
    at once, greeted within `timeout` seconds. AgentUnavailable: the host has no usable python3
    (missing, too old, hanging, answering junk), and `conn` is left open as it was (usable in
    channel mode); a connection lost meanwhile is ConnectionLost(started=False) and any other
    failure is raised as it is, `conn` closed either way."""
    try:
        # Two more for the executor than the pool leases: kills of timed-out commands.
        agent = await start_agent(
            conn,
            target.limits.agent_max_commands + 2,
            python=target.agent_python,
            timeout=timeout,
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


# exec_mode "auto": after a connection whose executor did not start, the host pool's next
# connections skip it for this long (then try again: a host may gain a python3), so a python3
# that hangs costs one connection in this many seconds its start timeout, not every one.
AUTO_RETRY = 300.0
# The outcomes of "auto" already logged, per host (address, port) and mode: once each for the
# whole process, whatever the accounts, connections and pools (one line per connection would
# repeat itself for every account of a host without python3).
announced: set[tuple[str, int, str]] = set()


class AgentMode:
    """A host pool's agent mode, by its Target.exec_mode: "channel", never; "agent", on until a
    connection finds no usable python3, then off for good; "auto", tried on each new connection
    where a connection has a channel to spare beside the executor's (max_sessions >= 2): a
    connection whose executor does not start runs its commands as channels, and the next ones
    skip the executor for AUTO_RETRY seconds. `error` says why it last failed; `exposed`, why
    its executors could not make themselves undumpable, once seen. Logged once each ("auto":
    once per host and outcome, `announced`)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.mode = target.exec_mode
        self.error: str | None = None
        self.exposed: str | None = None
        self.off = False
        self.retry_at = 0.0

    @property
    def on(self) -> bool:
        """Does the next connection start an executor?"""
        if self.mode == "agent":
            return not self.off
        if self.mode == "auto":
            return self.target.limits.max_sessions >= 2 and time.monotonic() >= self.retry_at
        return False

    @property
    def start_timeout(self) -> float:
        """How long the executor's start may take: "auto" counts it in the connect, so a
        python3 that hangs costs a connection connect_timeout at most before it runs as
        channels (a login slower than that runs as channels too)."""
        lim = self.target.limits
        if self.mode == "auto":
            return min(lim.agent_start_timeout, lim.connect_timeout)
        return lim.agent_start_timeout

    def announce(self, mode: str, level: int, message: str, *args: object) -> None:
        key = (self.target.host, self.target.port, mode)
        if key not in announced:
            announced.add(key)
            log.log(level, message, *args)

    def unavailable(self, exc: AgentUnavailable) -> None:
        self.error = str(exc)[:500]
        if self.mode == "auto":
            self.retry_at = time.monotonic() + AUTO_RETRY
            self.announce(
                "channel",
                logging.WARNING,
                "%s: exec_mode auto: %s; connections whose executor does not start run their "
                "commands as channels (an account's next connections try again after %d s)",
                self.target,
                self.error,
                AUTO_RETRY,
            )
        elif not self.off:
            self.off = True
            log.warning("%s: %s; this host's commands run as channels instead", self.target, exc)

    def started(self, agent: AgentConnection) -> None:
        if self.mode == "auto":
            self.announce(
                "agent",
                logging.INFO,
                "%s: exec_mode auto: agent mode (python %s answered)",
                self.target,
                str(agent.hello.get("python", "?"))[:20],
            )
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
    (`start_executor`, counted in `counters["agents_started"]`). A connection whose
    executor does not start (no usable python3) is given as it is, for channels, and tells
    `agent` (`AgentMode.unavailable`); a connection lost meanwhile is a failed connect. A
    failed connect's error carries its stamps (`stages`)."""
    stamps = Stages()
    try:
        with stamping(stamps):
            conn = await handshake(backend, target, wanted, counters)
        if not agent.on:
            return conn, target.limits.max_sessions, stamps
        began = time.time_ns()
        try:
            executor = await start_executor(conn, target, agent.start_timeout)
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
