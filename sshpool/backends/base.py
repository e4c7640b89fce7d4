"""The backend interface: the little the pool needs from an SSH library.

A backend connects a Target; a connection runs one command per channel, many at once, and opens
SFTP sessions (the sftp subsystem on a channel of its own, `Connection.sftp`). Backends
raise only sshpool.errors exceptions: each translates its library's errors in one place (its own
table, plus the shared rules of `sshpool.backends.translate`).

Only the interface lives here (with `realpaths_in_turn` and `realpath_or_none`, what its
backends share for `SFTPSession.realpaths`); `sshpool.backends.load_backend` finds a backend by
name.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from sshpool.command import Capture, Stdin
from sshpool.errors import RemoteFileError
from sshpool.target import Target


@dataclass(frozen=True, slots=True)
class Exit:
    """How the remote command ended: an exit status, or the signal that killed it."""

    status: int | None
    signal: str | None = None


FileType = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True, slots=True)
class FileAttrs:
    """What SFTP says of one file: its type, size in bytes, permission bits (`mode & 0o7777`),
    and modification time (seconds since the epoch; SFTP v3 has whole seconds only)."""

    type: FileType
    size: int
    mode: int
    mtime: int

    @staticmethod
    def from_mode(mode: int | None, size: int | None, mtime: int | float | None) -> FileAttrs:
        """From a POSIX st_mode (S_IFMT bits included), as every SFTP library reports it."""
        kind = (mode or 0) & 0o170000
        types: dict[int, FileType] = {0o100000: "file", 0o040000: "dir", 0o120000: "symlink"}
        return FileAttrs(types.get(kind, "other"), size or 0, (mode or 0) & 0o7777, int(mtime or 0))


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of a directory listing: its name (no path) and its own attributes (lstat: a
    symlink is reported as one, not followed)."""

    name: str
    attrs: FileAttrs


class RemoteFile(Protocol):
    """An open remote file, for reading from an offset or for writing from the start."""

    async def read(self, size: int) -> bytes:
        """Up to `size` bytes from the current position (several SFTP requests in flight where
        the library can); b"" at end of file."""
        ...

    async def write(self, data: bytes) -> None:
        """Write all of `data` at the current position. A full filesystem raises RemoteNoSpace.
        It may return while the last of its requests are still unanswered (at most one call's
        bytes: the next call's requests then go out behind them, so a long round trip does not
        empty the pipe between two calls); their failure is raised by a later write, `flush`
        or `close`."""
        ...

    async def flush(self) -> None:
        """Wait until every write so far is answered by the host; raises a failed one's error."""
        ...

    async def close(self) -> None:
        """Close the handle (flushed first); for a written file, raises the RemoteFileError of a
        failed write or flush. Idempotent."""
        ...


class SFTPSession(Protocol):
    """The sftp subsystem on one channel of a pooled connection. Paths are the host's (bytes are
    UTF-8 text); a relative path resolves against the account's home directory.

    Every method raises RemoteFileError subclasses for an error status of the host (the session
    stays usable) and ConnectionLost(started=True) when the connection drops (the operation may
    have happened). A session runs one operation at a time: callers await each before the next.
    """

    async def realpath(self, path: str) -> str:
        """The canonical absolute path: `.` and `..` removed and every symlink followed (as
        OpenSSH's sftp-server does; a missing final component is allowed there)."""
        ...

    async def realpaths(self, paths: Sequence[str]) -> list[str | None]:
        """`realpath` of each path, in order, None where the host answered an error status
        (missing, not searchable). One operation: a backend that can send SFTP requests
        together sends them all at once (one round trip for the lot on a long path), the others
        one after another (`realpaths_in_turn`). The caller bounds how many."""
        ...

    async def stat(self, path: str) -> FileAttrs:
        """Attributes of the file `path` names, following symlinks."""
        ...

    async def lstat(self, path: str) -> FileAttrs:
        """Attributes of `path` itself: a symlink is reported as a symlink."""
        ...

    async def readlink(self, path: str) -> str:
        """The target text of the symlink `path` (not resolved)."""
        ...

    async def listdir(self, path: str) -> list[DirEntry]:
        """The entries of directory `path` with their lstat attributes, `.` and `..` left out."""
        ...

    def scandir(self, path: str) -> AsyncGenerator[DirEntry, None]:
        """The entries of directory `path` one at a time, in the host's order (not sorted), with
        their lstat attributes, `.` and `..` left out. A directory is read as it is consumed,
        one READDIR request at a time (a reply holds up to ~100 names with OpenSSH): a caller
        that stops early has read at most one reply beyond what it took, whatever the size of
        the directory. The caller closes the iterator (`contextlib.aclosing`), which closes the
        directory handle; the session runs nothing else until then."""
        ...

    async def open_read(self, path: str, offset: int = 0) -> RemoteFile:
        """Open `path` for reading, positioned at `offset`."""
        ...

    async def open_write(
        self, path: str, *, exclusive: bool = True, mode: int = 0o644
    ) -> RemoteFile:
        """Create `path` for writing (O_CREAT|O_TRUNC; with `exclusive`, O_EXCL: fail when it
        exists, never following a symlink there). RemoteFileFailure when it exists."""
        ...

    async def open_resume(self, path: str, offset: int) -> RemoteFile:
        """Open the existing file `path` for writing at `offset` (SFTP OPEN with WRITE only:
        never created, never truncated): what is written next replaces the bytes from `offset`
        on, and those before it stay. A resumable upload's next chunk (api/files/resumable.py)."""
        ...

    async def rename(self, old: str, new: str, *, overwrite: bool) -> None:
        """Rename `old` to `new`. With `overwrite`, atomically replace an existing `new`
        (posix-rename@openssh.com where the server offers it); without, fail with
        RemoteFileFailure when `new` exists (SFTP v3 rename never replaces)."""
        ...

    async def remove(self, path: str) -> None:
        """Remove the file (or the symlink itself) `path`."""
        ...

    async def rmdir(self, path: str) -> None:
        """Remove the empty directory `path`."""
        ...

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        """Create the directory `path` (its parent must exist)."""
        ...

    async def setstat(
        self, path: str, *, mode: int | None = None, mtime: int | None = None
    ) -> None:
        """Set `path`'s permission bits (not subject to the umask, unlike a mode given at
        creation) and/or its modification time (the access time with it: SFTP v3 sets both)."""
        ...

    def intact(self) -> bool:
        """Whether the connection can still serve other channels once this session is closed,
        also after an operation was cancelled half-way (a client gone mid-download). Judged
        without I/O; the pool retires the connection when it is not."""
        ...

    async def close(self) -> None:
        """Close the session's channel. Idempotent, best effort, never raises."""
        ...


class Connection(Protocol):
    def is_alive(self) -> bool:
        """True while the transport is up, judged without I/O."""
        ...

    async def exec(
        self, command: str, stdin: bytes | Stdin | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        """Open a session channel, run `command`, write `stdin` then EOF, drain both streams
        concurrently into the captures, and return how it ended. With a `Stdin` for `stdin`,
        what is written to it goes out as it comes (EOF when it is closed): agent mode's
        executor channel.

        Output is fed to the captures on the event loop's thread, chunk by chunk as the channel
        delivers it (never held back until the end): `Capture.on_data` observers (live output)
        rely on that. Feeding never waits on the capture; the hook must not block either.

        Raises ChannelRefused when sshd refuses the channel, and ConnectionLost (with `started`
        true once the exec request may have reached sshd) when the transport drops. On
        cancellation it sends the TERM signal request (best effort), closes the channel and
        re-raises; killing the process group is the pool's job.
        """
        ...

    async def sftp(self) -> SFTPSession:
        """Open a session channel and start the sftp subsystem on it. Raises ChannelRefused when
        sshd refuses the channel (MaxSessions), ConnectionLost(started=False) when the
        transport drops, RemoteFileFailure when the host has no sftp subsystem."""
        ...

    async def close(self) -> None:
        """Close the connection. Idempotent, best effort, never raises."""
        ...


class Backend(Protocol):
    name: str

    async def connect(self, target: Target) -> Connection:
        """Connect, verify the host key against target.known_hosts (fail closed), authenticate
        with target.client_keys, within target.limits.connect_timeout. Sets TCP_NODELAY and
        keepalives from target.limits. Raises ConnectTimeout or a ConnectError."""
        ...


async def realpath_or_none(session: SFTPSession, path: str) -> str | None:
    """`session.realpath(path)`, None where the host answered an error status (one answer of
    `SFTPSession.realpaths`)."""
    try:
        return await session.realpath(path)
    except RemoteFileError:
        return None


async def realpaths_in_turn(session: SFTPSession, paths: Sequence[str]) -> list[str | None]:
    """`SFTPSession.realpaths` one request after another: for a backend whose session cannot
    have two requests in flight."""
    return [await realpath_or_none(session, path) for path in paths]
