"""A pooled connection (`PooledConn`) and one channel slot on it held for one exec (`Lease`):
the bookkeeping the host pool keeps per connection, and how one command runs on a slot (a
channel behind the login shell's marker line, or argv on agent mode's executor) with its
captures and stage timings; the one kill of a process group (`kill_group`) and the one retry
policy of a slot's use (`retried`). State changes stay in the host pool
(`sshpool.host.HostPool`); nothing here decides what becomes of a slot.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from sshpool.agent import AgentConnection
from sshpool.backends import Connection, Exit
from sshpool.command import (
    Capture,
    CommandResult,
    OutputStream,
    command_line,
    kill_group_line,
    new_marker,
    wrap,
)
from sshpool.errors import ChannelRefused, ConnectionLost
from sshpool.target import Target
from sshpool.tracing import Stages, exec_spans, recording

log = logging.getLogger("sshpool")

T = TypeVar("T")

# A lease refused this many times in a row gives up (sshd refuses even a lone channel).
MAX_REFUSALS = 20
# After this many clean channel opens since the last refusal, a shrunk capacity grows back by one.
REGROW_AFTER = 100


# Each pooled connection's ident, unique in the process (never reused, unlike id()).
_idents = itertools.count(1)


class PooledConn:
    """A pooled connection and its bookkeeping."""

    __slots__ = (
        "capacity",
        "ceiling",
        "clean_opens",
        "conn",
        "connect_time",
        "created",
        "expired",
        "for_room",
        "ident",
        "idle_since",
        "in_use",
        "leases",
        "noisy_login",
        "served",
        "sftp",
        "sftp_capacity",
        "sftp_ceiling",
        "stages",
    )

    def __init__(
        self,
        conn: Connection,
        capacity: int,
        now: float,
        connect_time: float,
        sftp_capacity: int | None = None,
        stages: Stages | None = None,
    ) -> None:
        self.conn = conn
        # Its handshake's stamps: the first lease traces them (sshpool.tracing).
        self.stages = stages
        # Names it to other processes sharing its sshd (`sshpool.budget.Sshd.lend`).
        self.ident = next(_idents)
        self.capacity = capacity
        # What capacity grows back to: max_sessions, or agent_max_commands on an executor.
        self.ceiling = capacity
        # On an executor's connection (agent mode) commands open no channel, SFTP sessions do:
        # they are counted apart, within the channels the executor leaves (None: a channel
        # connection, where a session's channel is its command slot).
        self.sftp = 0
        self.sftp_capacity = self.sftp_ceiling = sftp_capacity
        self.in_use = 0
        self.created = now
        self.idle_since = now
        self.connect_time = connect_time
        self.expired = False
        # Closed to make room at the sshd for another account (counted in sshd.evicting).
        self.for_room = False
        self.leases = 0
        self.clean_opens = 0
        # A command ran to its end here (the account's login shell lets commands through).
        self.served = False
        # Something printed before our marker line (warned once per connection).
        self.noisy_login = False

    def regrow(self) -> None:
        """A clean channel open: after REGROW_AFTER of them a shrunk connection grows by one
        (called by the host pool, whose state this is, in its synchronous steps)."""
        self.clean_opens += 1
        if self.clean_opens >= REGROW_AFTER:
            if self.capacity < self.ceiling:
                self.capacity += 1
                self.clean_opens = 0
            if self.sftp_capacity is not None and self.sftp_capacity < (self.sftp_ceiling or 0):
                self.sftp_capacity += 1
                self.clean_opens = 0

    def has_room(self, sftp: bool = False) -> bool:
        if sftp and self.sftp_capacity is not None and self.sftp >= self.sftp_capacity:
            return False
        return not self.expired and self.in_use < self.capacity and self.conn.is_alive()


class Lease:
    """One channel slot on a pooled connection, held for one exec (see `HostPool.lease`), with
    that exec's captures and stage timings."""

    __slots__ = ("conn", "err", "out", "t_leased", "t_started", "timings")

    def __init__(self, conn: PooledConn, since: float) -> None:
        self.conn = conn
        self.t_leased = time.perf_counter()
        self.timings = {"queue": self.t_leased - since, "connect": 0.0}
        if conn.leases == 0:
            # This lease waited for the connection to be made: account that to connect.
            self.timings["connect"] = min(conn.connect_time, self.timings["queue"])
            self.timings["queue"] -= self.timings["connect"]
        conn.leases += 1
        self.out: Capture | None = None
        self.err: Capture | None = None
        self.t_started: float | None = None

    @property
    def pgid(self) -> int | None:
        """The remote process group of the exec, once the command has started."""
        return None if self.out is None else self.out.pgid

    async def exec(
        self,
        command: str | Sequence[str],
        stdin: bytes | None,
        max_output: int,
        on_started: Callable[[int], None] | None,
        on_output: Callable[[OutputStream, bytes], None] | None = None,
    ) -> Exit:
        """Run `command` (a shell line, or argv) on this slot. A lost connection counts as
        started once the command reported its process group, and carries that group. On an
        executor (agent mode) argv starts with no shell; anything else goes through the login
        shell behind the marker line (module docstring of sshpool.command)."""

        # Traced (inside a recording span): its open, run and first output byte become spans
        # once it ends (`sshpool.tracing.exec_spans`); untraced, none of this is stamped.
        traced = recording()
        t_exec = time.time_ns() if traced else 0
        stamps: dict[str, int] = {}

        def started() -> None:
            self.t_started = time.perf_counter()
            if traced:
                stamps["started"] = time.time_ns()
            if on_started is not None and out.pgid is not None:
                on_started(out.pgid)

        if traced:
            forward = on_output

            def first_byte(stream: OutputStream, chunk: bytes) -> None:
                if "first" not in stamps:
                    stamps["first"] = time.time_ns()
                if forward is not None:
                    forward(stream, chunk)

            on_output = first_byte

        on_out = on_err = None
        if on_output is not None:
            on_out = functools.partial(on_output, "stdout")
            on_err = functools.partial(on_output, "stderr")
        conn = self.conn.conn
        agent = isinstance(conn, AgentConnection) and not isinstance(command, str)
        if agent:
            assert isinstance(conn, AgentConnection) and not isinstance(command, str)
            out = self.out = Capture(max_output, on_data=on_out)
            self.err = Capture(max_output, on_data=on_err)

            def on_pgid(pgid: int | None) -> None:
                out.pgid = pgid if pgid is not None and pgid > 1 else None
                started()

            run = conn.run_argv(command, stdin, out, self.err, on_pgid)
        else:
            line = command if isinstance(command, str) else command_line(command)
            marker = new_marker()
            out = self.out = Capture(max_output, marker=marker, on_start=started, on_data=on_out)
            self.err = Capture(max_output, on_data=on_err)
            run = conn.exec(wrap(line, marker), stdin, out, self.err)
        error: BaseException | None = None
        end: Exit | None = None
        try:
            end = await run
            return end
        except ConnectionLost as exc:
            exc.started = exc.started or out.pgid is not None
            exc.remote_pgid = out.pgid
            error = exc
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if traced:
                status = None if end is None else end.status
                first = stamps.get("first")
                exec_spans(agent, t_exec, stamps.get("started"), first, status, error)
            if out.preamble and not self.conn.noisy_login:
                # A login script or ~/.ssh/rc printed before the command: not its output, but
                # the operator should know (once per connection).
                self.conn.noisy_login = True
                log.warning(
                    "the login printed %d bytes before the command (dropped from its output): %r",
                    len(out.preamble),
                    out.preamble[:200],
                )

    def result(self, end: Exit | None) -> CommandResult:
        """The exec's result (`end` None: it did not end on its own), with its timings."""
        assert self.out is not None and self.err is not None
        t_end = time.perf_counter()
        result = CommandResult.from_captures(
            end.status if end else None, end.signal if end else None, self.out, self.err
        )
        t_started = self.t_started if self.t_started is not None else t_end
        result.timings = {
            **self.timings,
            "open": t_started - self.t_leased,
            "exec": t_end - t_started,
        }
        return result


async def kill_group(conn: Connection, pgid: int) -> None:
    """The one kill: TERM the remote process group, KILL it after a grace period."""
    await conn.exec(kill_group_line(pgid), None, Capture(4096), Capture(4096))


async def retried(target: Target, attempt: Callable[[], Awaitable[T]]) -> T:
    """`attempt()` (take a slot of `target`, open a channel on it, use it), again while it
    fails before anything ran: after a refused channel (the connection already shrunk) with a
    growing pause, up to MAX_REFUSALS in a row; after a connection lost before the start
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
                    f"{target}: sshd refused {refusals} channels in a row", started=False
                ) from None
            await asyncio.sleep(0.005 * refusals)
        except ConnectionLost as exc:
            if exc.started or lost_retried:
                raise
            lost_retried = True  # it never ran: once more, on a fresh connection
