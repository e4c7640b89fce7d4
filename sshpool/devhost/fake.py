"""A fake SSH backend for testing pool logic without SSH, as httpcore ships its mock backend.

```python
backend = FakeBackend(sshd_max_sessions=5, exec_time=0.05)
async with Pool(backend) as pool:
    result = await pool.run(target, ["true"])   # stdout b"conn0": the connection that ran it
```

It keeps the contract of `sshpool.backends.base` and plays the parts of sshd the pool reacts to:
a per-connection channel limit (ChannelRefused past `sshd_max_sessions`), connect failures in
order (`connect_failures`), connections that drop before or after the command started (`lose`).
An SFTP session (`FakeConnection.sftp`) takes a channel like an exec, is recorded in `order`
as ``sftp``, resolves paths as given and has no files.
What it records (`order`, `conns`, `max_in_flight`) is what the tests assert on.

Every exec prints the wrapper's marker line first (``<token> 4242``, the token taken from the
line the pool sent, as the remote shell's ``echo <token> $$`` would), read by the pool as the
remote process group id, then ``conn<number>`` once it ran `exec_time` seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from sshpool.backends import Exit
from sshpool.backends.base import DirEntry, FileAttrs, RemoteFile
from sshpool.command import Capture
from sshpool.errors import ChannelRefused, ConnectionLost, RemoteNotFound
from sshpool.target import Target

if TYPE_CHECKING:
    from sshpool.pool import Pool

# The process group id every fake command reports.
FAKE_PGID = 4242


@dataclass
class FakeConnection:
    """One fake connection: `alive` until closed or lost; counts running and finished execs."""

    backend: FakeBackend
    number: int
    alive: bool = True
    running: int = 0
    execs: int = 0

    def is_alive(self) -> bool:
        return self.alive

    async def exec(
        self, command: str, stdin: bytes | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        b = self.backend
        if self.running >= b.sshd_max_sessions:
            raise ChannelRefused("open failed")
        if b.lose and b.lose[0] == "before":
            b.lose.pop(0)
            self.alive = False
            raise ConnectionLost("reset", started=False)
        self.running += 1
        self.execs += 1
        b.order.append(command)
        try:
            # `wrap` sends "echo <token> $$; <command>": answer as the shell would.
            token = command.partition(" $$; ")[0].removeprefix("echo ")
            stdout.feed(f"{token} {FAKE_PGID}\n".encode())
            if b.lose and b.lose[0] == "after":
                b.lose.pop(0)
                self.alive = False
                raise ConnectionLost("reset while running", started=True)
            await asyncio.sleep(b.exec_time)
            stdout.feed(f"conn{self.number}".encode())
            return Exit(0)
        finally:
            self.running -= 1

    async def sftp(self) -> FakeSFTP:
        if self.running >= self.backend.sshd_max_sessions:
            raise ChannelRefused("open failed")
        self.running += 1
        self.backend.order.append("sftp")
        return FakeSFTP(self)

    async def close(self) -> None:
        await asyncio.sleep(self.backend.close_time)
        self.alive = False


class FakeSFTP:
    """An SFTP session of a fake connection: holds its channel until closed; has no files."""

    def __init__(self, conn: FakeConnection) -> None:
        self.conn: FakeConnection | None = conn

    async def realpath(self, path: str) -> str:
        return path

    async def realpaths(self, paths: Sequence[str]) -> list[str | None]:
        return list(paths)

    async def stat(self, path: str) -> FileAttrs:
        raise RemoteNotFound("no such file", path)

    async def lstat(self, path: str) -> FileAttrs:
        raise RemoteNotFound("no such file", path)

    async def readlink(self, path: str) -> str:
        raise RemoteNotFound("no such file", path)

    async def listdir(self, path: str) -> list[DirEntry]:
        raise RemoteNotFound("no such file", path)

    async def open_read(self, path: str, offset: int = 0) -> RemoteFile:
        raise RemoteNotFound("no such file", path)

    async def open_write(
        self, path: str, *, exclusive: bool = True, mode: int = 0o644
    ) -> RemoteFile:
        raise RemoteNotFound("no such directory", path)

    async def open_resume(self, path: str, offset: int) -> RemoteFile:
        raise RemoteNotFound("no such file", path)

    async def rename(self, old: str, new: str, *, overwrite: bool) -> None:
        raise RemoteNotFound("no such file", old)

    async def remove(self, path: str) -> None:
        raise RemoteNotFound("no such file", path)

    async def rmdir(self, path: str) -> None:
        raise RemoteNotFound("no such file", path)

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        raise RemoteNotFound("no such file", path)

    def intact(self) -> bool:
        return True

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.running -= 1
            self.conn = None


@dataclass
class FakeBackend:
    """A backend whose connections are `FakeConnection`s.

    Knobs: `connect_time`, `exec_time` and `close_time` (seconds), `sshd_max_sessions`
    (channels per connection before ChannelRefused), `connect_failures` (raised by the next
    connects, in order), `lose` ("before" / "after": the next execs lose their connection
    before or after the start).
    Records: `order` (every command line run, in order), `conns` (every connection made),
    `in_flight` and `max_in_flight` (connects at once), `max_alive` (connections open at once,
    counted as sshd would: from the connect until the close).
    """

    name: str = "fake"
    connect_time: float = 0.05
    exec_time: float = 0.01
    close_time: float = 0.0
    sshd_max_sessions: int = 100
    connect_failures: list[Exception] = field(default_factory=list)
    lose: list[Literal["before", "after"]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    conns: list[FakeConnection] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    max_alive: int = 0

    def started_ahead(self, before: int, mine: str) -> int:
        """How many commands this host started after index `before` of `order`, ahead of the
        first line containing `mine`: in event order, which a loaded box does not change where
        milliseconds stretch (the fair-share tests count turns with it)."""
        return next(n for n, line in enumerate(self.order[before:]) if mine in line)

    async def connect(self, target: Target) -> FakeConnection:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.connect_time)
            if self.connect_failures:
                raise self.connect_failures.pop(0)
        finally:
            self.in_flight -= 1
        conn = FakeConnection(self, len(self.conns))
        self.conns.append(conn)
        self.max_alive = max(self.max_alive, sum(1 for c in self.conns if c.alive))
        return conn


async def backlog_queued(pool: Pool, target: Target, waiting: int = 250) -> None:
    """Until more than `waiting` callers wait for a slot of `target`: a backlog has queued and
    the slots are busy (a fixed sleep is not enough on a loaded box)."""
    async with asyncio.timeout(10):
        while pool.stats().get(target, {}).get("waiters", 0) <= waiting:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
