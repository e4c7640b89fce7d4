"""The asyncssh backend: native asyncio, one SSH connection multiplexes many session channels.

asyncssh does nearly everything itself (known_hosts, host key preference, keepalives and dead
peer detection, exit signals). What it does not do and this module adds:
- A liveness flag that needs no I/O (`is_alive`), from the connection_lost callback.
- `started` on a lost connection: whether the exec request may have reached sshd.
- The SSH signal request (TERM) on cancel, best effort.
- SFTP (`sftp()`): asyncssh's own client, its errors in our tree, ENOSPC told apart by statvfs.

Every asyncssh error is translated into sshpool.errors here (its table) and in
`sshpool.backends.translate` (the shared rules), nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, cast

import asyncssh

from sshpool import tracing
from sshpool.backends import translate
from sshpool.backends.base import DirEntry, Exit, FileAttrs, realpath_or_none
from sshpool.command import Capture, Stdin
from sshpool.errors import (
    AuthenticationFailed,
    ChannelRefused,
    ConnectError,
    ConnectionLost,
    HostKeyMismatch,
    RemoteFileError,
    SSHPoolError,
)
from sshpool.target import Target


def _connect_table(exc: BaseException, target: Target) -> SSHPoolError | None:
    """asyncssh's exceptions in our tree; the shared rules (translate.connect_error) do the rest."""
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return HostKeyMismatch(f"{target}: host key not in {target.known_hosts}: {exc.reason}")
    if isinstance(exc, asyncssh.PermissionDenied):
        return AuthenticationFailed(f"{target}: no client key accepted: {exc.reason}")
    if isinstance(exc, asyncssh.ConnectionLost):
        return translate.dropped(target, exc)
    if isinstance(exc, asyncssh.DisconnectError):
        return ConnectError(f"{target}: disconnected during handshake: {exc.reason}")
    return None


class _Client(asyncssh.SSHClient):
    """Tracks whether the transport is up, so is_alive() needs no I/O; stamps the key
    exchange's and the authentication's ends for the connect's trace (`sshpool.tracing`)."""

    def __init__(self, stages: tracing.Stages | None = None) -> None:
        self.alive = True
        self.stages = stages

    def begin_auth(self, username: str) -> None:
        # asyncssh asks for the userauth service once the first key exchange is done.
        if self.stages is not None:
            self.stages.mark("key_exchange")

    def auth_completed(self) -> None:
        if self.stages is not None:
            self.stages.mark("authentication")

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False


class _Session(asyncssh.SSHClientSession[bytes]):
    """Feeds channel data into the captures and resolves `done` when the channel closes."""

    def __init__(self, stdout: Capture, stderr: Capture) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.chan: asyncssh.SSHClientChannel[bytes] | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:
        # The channel is open and the exec request goes out next: from here on the command
        # may run, so a lost connection is no longer safe to retry.
        self.chan = chan

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            self.stderr.feed(data)
        else:
            self.stdout.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


class _Pour:
    """Writes what a Stdin was given to the channel as it is given (asyncssh buffers it)."""

    def __init__(self, feed: Stdin, chan: asyncssh.SSHClientChannel[bytes]) -> None:
        self.feed = feed
        self.chan = chan
        self.eof_sent = False

    def __call__(self) -> None:
        data, eof = self.feed.take()
        if self.eof_sent or self.chan.is_closing():
            return
        with contextlib.suppress(asyncssh.Error, OSError):
            if data:
                self.chan.write(data)
            if eof:
                self.eof_sent = True
                self.chan.write_eof()


def _attrs(attrs: asyncssh.SFTPAttrs) -> FileAttrs:
    return FileAttrs.from_mode(attrs.permissions, attrs.size, attrs.mtime)


@contextlib.asynccontextmanager
async def _sftp_errors(path: str | None) -> AsyncIterator[None]:
    """asyncssh's SFTP errors in our tree: a status from the host, or a lost connection."""
    try:
        yield
    except asyncssh.SFTPError as exc:
        # 6 no connection (asyncssh's answer once the channel has closed), 7 connection lost.
        if exc.code in (6, 7):
            message = f"connection lost during SFTP: {exc.reason}"
            raise ConnectionLost(message, started=True) from exc
        raise translate.sftp_error(exc.code, exc.reason, path) from exc
    except (asyncssh.Error, OSError, EOFError) as exc:
        raise ConnectionLost(f"connection lost during SFTP: {exc}", started=True) from exc


class AsyncsshFile:
    """An open file. Writes go out behind each other: a write starts its requests at once
    (at its own offset, asyncssh's parallel writes) and returns when the write before it is
    answered, so the next call's requests follow the last ones of this call without waiting
    for their answers: on a long path the pipe does not empty between two calls (a round trip
    per call otherwise; docs/files.md, "Long paths"). At most two calls' bytes are in flight."""

    def __init__(
        self, sftp: asyncssh.SFTPClient, f: asyncssh.SFTPClientFile, path: str, offset: int = 0
    ) -> None:
        self._sftp = sftp
        self._f = f
        self._path = path
        self._closed = False
        self._offset = offset  # where the next write goes
        self._behind: asyncio.Future[None] | None = None

    async def read(self, size: int) -> bytes:
        async with _sftp_errors(self._path):
            data: bytes = await self._f.read(size)
        return data

    async def write(self, data: bytes) -> None:
        offset, self._offset = self._offset, self._offset + len(data)
        ahead = asyncio.ensure_future(self._write_at(data, offset))
        previous, self._behind = self._behind, ahead
        if previous is not None:
            # Shielded: a cancelled caller leaves it to flush or close to wait for it, so no
            # request is cut off half-way on the session.
            await asyncio.shield(previous)

    async def _write_at(self, data: bytes, offset: int) -> None:
        try:
            async with _sftp_errors(self._path):
                await self._f.write(data, offset)
        except RemoteFileError as exc:
            raise await self._why(exc) from exc

    async def flush(self) -> None:
        behind, self._behind = self._behind, None
        if behind is not None:
            await asyncio.shield(behind)

    async def _why(self, exc: RemoteFileError) -> RemoteFileError:
        free: int | None = None
        with contextlib.suppress(asyncssh.Error, OSError):
            vfs = await self._f.statvfs()
            free = vfs.bavail * vfs.frsize
        return translate.write_failed(exc, free)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.flush()
        finally:
            async with _sftp_errors(self._path):
                await self._f.close()


class AsyncsshSFTP:
    def __init__(self, sftp: asyncssh.SFTPClient) -> None:
        self._sftp = sftp

    async def realpath(self, path: str) -> str:
        async with _sftp_errors(path):
            result: str = await self._sftp.realpath(path)
        return result

    async def realpaths(self, paths: Sequence[str]) -> list[str | None]:
        # asyncssh sends a request at once and matches its answer by id: all go out together.
        asked = (realpath_or_none(self, path) for path in paths)
        found: list[str | None] = []
        for answer in await asyncio.gather(*asked, return_exceptions=True):
            if isinstance(answer, BaseException):
                raise answer  # the connection lost: every request failed alike
            found.append(answer)
        return found

    async def stat(self, path: str) -> FileAttrs:
        async with _sftp_errors(path):
            return _attrs(await self._sftp.stat(path))

    async def lstat(self, path: str) -> FileAttrs:
        async with _sftp_errors(path):
            return _attrs(await self._sftp.lstat(path))

    async def readlink(self, path: str) -> str:
        async with _sftp_errors(path):
            result: str = await self._sftp.readlink(path)
        return result

    async def listdir(self, path: str) -> list[DirEntry]:
        async with _sftp_errors(path):
            names = await self._sftp.readdir(path)
        return [
            DirEntry(str(n.filename), _attrs(n.attrs))
            for n in names
            if n.filename not in (".", "..")
        ]

    async def scandir(self, path: str) -> AsyncGenerator[DirEntry, None]:
        # SFTPClient.scandir sends one READDIR at a time and closes the handle when closed
        # (an async generator, typed as an iterator).
        names = cast(AsyncGenerator[asyncssh.SFTPName, None], self._sftp.scandir(path))
        async with _sftp_errors(path), contextlib.aclosing(names):
            async for n in names:
                if n.filename not in (".", ".."):
                    yield DirEntry(str(n.filename), _attrs(n.attrs))

    async def open_read(self, path: str, offset: int = 0) -> AsyncsshFile:
        async with _sftp_errors(path):
            f = await self._sftp.open(path, "rb")
        await f.seek(offset)
        return AsyncsshFile(self._sftp, f, path)

    async def open_write(
        self, path: str, *, exclusive: bool = True, mode: int = 0o644
    ) -> AsyncsshFile:
        attrs = asyncssh.SFTPAttrs(permissions=mode)
        async with _sftp_errors(path):
            f = await self._sftp.open(path, "xb" if exclusive else "wb", attrs)
        return AsyncsshFile(self._sftp, f, path)

    async def open_resume(self, path: str, offset: int) -> AsyncsshFile:
        # "r+b": READ|WRITE, no CREAT, no TRUNC; each write names its offset (the file's own).
        async with _sftp_errors(path):
            f = await self._sftp.open(path, "r+b")
        await f.seek(offset)
        return AsyncsshFile(self._sftp, f, path, offset)

    async def rename(self, old: str, new: str, *, overwrite: bool) -> None:
        async with _sftp_errors(old):
            if overwrite:
                # OpenSSH's extension; asyncssh raises SFTPOpUnsupported (-> a failure) without.
                await self._sftp.posix_rename(old, new)
            else:
                await self._sftp.rename(old, new)

    async def remove(self, path: str) -> None:
        async with _sftp_errors(path):
            await self._sftp.remove(path)

    async def rmdir(self, path: str) -> None:
        async with _sftp_errors(path):
            await self._sftp.rmdir(path)

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        async with _sftp_errors(path):
            await self._sftp.mkdir(path, asyncssh.SFTPAttrs(permissions=mode))

    async def setstat(
        self, path: str, *, mode: int | None = None, mtime: int | None = None
    ) -> None:
        attrs = asyncssh.SFTPAttrs(permissions=mode, atime=mtime, mtime=mtime)
        async with _sftp_errors(path):
            await self._sftp.setstat(path, attrs)

    def receive_window(self) -> int | None:
        """The receive window its channel was opened with (what sshd may send unanswered)."""
        handler = getattr(self._sftp, "_handler", None)
        reader = getattr(handler, "_reader", None)
        return None if reader is None else int(reader.channel.get_recv_window())

    def intact(self) -> bool:
        # A cancelled request only leaves its reply unread on this session's own channel,
        # which close() ends; the connection and its other channels never see it.
        return True

    async def close(self) -> None:
        self._sftp.exit()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._sftp.wait_closed(), timeout=5)


class AsyncsshConnection:
    def __init__(self, conn: asyncssh.SSHClientConnection, client: _Client) -> None:
        self._conn = conn
        self._client = client
        # The receive window of the next SFTP sessions' channels (None: asyncssh's 2 MiB): the
        # transfer lane sizes it from the bandwidth-delay product (sshpool.lane, `Wan`).
        self.sftp_window: int | None = None

    def is_alive(self) -> bool:
        return self._client.alive

    def _open_failed(self, exc: asyncssh.ChannelOpenError, started: bool) -> SSHPoolError:
        """A channel (an exec's or an SFTP session's) that sshd would not open: refused while
        the connection lives, lost with it otherwise."""
        if not self.is_alive():
            return ConnectionLost(str(exc), started=started)
        # MaxSessions: "open failed" (code 2) on OpenSSH 9, code 1 on older sshd.
        return ChannelRefused(f"channel refused: {exc.reason}")

    async def exec(
        self, command: str, stdin: bytes | Stdin | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        session = _Session(stdout, stderr)
        try:
            chan, _ = await self._conn.create_session(lambda: session, command, encoding=None)
        except asyncssh.ChannelOpenError as exc:
            raise self._open_failed(exc, started=session.chan is not None) from exc
        except (asyncssh.Error, OSError) as exc:
            raise ConnectionLost(str(exc), started=session.chan is not None) from exc
        except asyncio.CancelledError:
            if session.chan is not None:
                session.chan.close()
            raise
        try:
            if isinstance(stdin, Stdin):
                stdin.subscribe(_Pour(stdin, chan))
            else:
                if stdin:
                    chan.write(stdin)
                chan.write_eof()
            await session.done
        except asyncio.CancelledError:
            # Best effort: sshd delivers it to the login shell only; the pool kills the group.
            with contextlib.suppress(Exception):
                chan.send_signal("TERM")
            chan.close()
            raise
        except (asyncssh.Error, OSError) as exc:
            raise ConnectionLost(f"connection lost while running: {exc}", started=True) from exc
        if not self.is_alive() and chan.get_exit_status() is None:
            raise ConnectionLost("connection lost while running", started=True)
        signal = chan.get_exit_signal()
        return Exit(status=chan.get_exit_status(), signal=signal[0] if signal else None)

    async def _start_sftp(self) -> asyncssh.SFTPClient:
        window = self.sftp_window
        if window is None:
            return await self._conn.start_sftp_client()
        # start_sftp_client opens its channel with asyncssh's default window and takes none:
        # the same two steps it takes, with the window given (asyncssh 2.14 to 2.24 alike).
        writer, reader, _ = await self._conn.open_session(
            subsystem="sftp", encoding=None, window=window
        )
        return await asyncssh.sftp.start_sftp_client(
            self._conn,
            asyncio.get_running_loop(),
            getattr(self._conn, "_utf8_decode_errors", "strict"),
            reader,
            writer,
            "utf-8",
            "strict",
            3,
        )

    async def sftp(self) -> AsyncsshSFTP:
        try:
            client = await self._start_sftp()
        except asyncssh.ChannelOpenError as exc:
            raise self._open_failed(exc, started=False) from exc
        except asyncssh.SFTPError as exc:
            raise translate.sftp_error(exc.code, f"no SFTP: {exc.reason}", None) from exc
        except (asyncssh.Error, OSError, EOFError) as exc:
            raise ConnectionLost(f"cannot start SFTP: {exc}", started=False) from exc
        return AsyncsshSFTP(client)

    async def close(self) -> None:
        self._conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._conn.wait_closed(), timeout=5)


# Cipher preference, first match with the server wins. asyncssh's own default puts
# chacha20-poly1305 first, which it runs as two separate cryptography calls per packet (ChaCha20
# for the length and payload, Poly1305 for the tag); AES-GCM is one AEAD call, with AES-NI on
# x86 and ARMv8 crypto extensions. Measured in docs/benchmarks.md (cipher choice).
ENCRYPTION_ALGS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes256-ctr",
    "aes192-ctr",
    "aes128-ctr",
)


# Writes gathered in one turn of the event loop go out together up to this size; a bigger
# one (an SFTP write) is sent at once, since joining it would copy it for nothing.
COALESCE_BYTES = 64 * 1024
# A socket read larger than this reaches asyncssh in pieces of this size. asyncssh keeps its
# input in one bytes object and slices off each packet it parses, copying what remains each
# time: a 256 KiB read (the event loop's read size) of 32 KiB packets (the most sshd sends on
# a channel) was copied about eight times over. Two packets a piece bounds that at about two;
# the figures are in docs/benchmarks.md ("Figures behind the code").
FEED_BYTES = 64 * 1024


class _CoalescingTransport:
    """The socket transport, with the writes of one event loop turn sent as one.

    asyncssh writes every SSH packet on its own, and precedes each channel packet with an
    SSH_MSG_IGNORE one (its traffic-analysis countermeasure): the open, exec, EOF and close of
    one command were 8 transport writes, each a send() system call (a large share of the API's
    CPU in py-spy's profiles). Gathered, they are 4; packets that go out in the same turn for
    several commands share one. Everything else goes to the real transport."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._size = 0
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)
        self._size += len(data)
        if self._size >= COALESCE_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending, self._size = [], 0
        if not self._transport.is_closing():
            with contextlib.suppress(ConnectionError):  # as asyncssh's own write does
                self._transport.write(data)

    def close(self) -> None:
        self._flush()  # the disconnect message goes out before the close
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Connector:
    """Opens the TCP connection for asyncssh and hands it a `_CoalescingTransport`. asyncssh
    takes any object with this `create_connection` as its `tunnel` (its
    `_TunnelConnectorProtocol`: what it connects through instead of a plain TCP connection).
    Stamps the TCP connect for the connect's trace (`sshpool.tracing`)."""

    def __init__(self, stages: tracing.Stages | None = None) -> None:
        self.stages = stages

    async def create_connection(
        self, session_factory: Any, remote_host: str, remote_port: int
    ) -> tuple[asyncio.BaseTransport, Any]:
        loop = asyncio.get_running_loop()
        began = time.time_ns()
        transport, protocol = await loop.create_connection(
            lambda: _CoalescingProtocol(session_factory()), remote_host, remote_port
        )
        if self.stages is not None:
            self.stages.mark("connect", began)
        return transport, protocol.conn  # asyncssh wants its own connection object back

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


class _CoalescingProtocol(asyncio.Protocol):
    """Passes the socket's events to asyncssh's connection, with the transport wrapped."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn.connection_made(_CoalescingTransport(transport))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if len(data) <= FEED_BYTES:
            self.conn.data_received(data)
            return
        view = memoryview(data)  # asyncssh appends each piece to its input: no copy here
        for start in range(0, len(data), FEED_BYTES):
            # A connection asyncssh closed on what it read (a MAC failure, a disconnect) drops
            # its transport at once (the abort itself comes later): the rest is not for it,
            # as it would not have parsed the rest of one whole read.
            if getattr(self.conn, "_transport", None) is None:
                return
            self.conn.data_received(view[start : start + FEED_BYTES])

    def eof_received(self) -> bool | None:
        result: bool | None = self.conn.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.connection_lost(exc)

    def pause_writing(self) -> None:
        self.conn.pause_writing()

    def resume_writing(self) -> None:
        self.conn.resume_writing()


class AsyncsshBackend:
    name = "asyncssh"

    async def connect(self, target: Target) -> AsyncsshConnection:
        limits = target.limits
        stages = tracing.stages()
        client = _Client(stages)
        creds = target.credentials()
        client_keys: list[Any] = list(target.client_keys)
        if creds is not None:
            # The fresh key and its certificate, from memory: nothing touches the disk.
            key = asyncssh.import_private_key(creds.private_key)
            client_keys = [(key, asyncssh.import_certificate(creds.certificate))]
        options: dict[str, Any] = {
            "username": target.username,
            "client_keys": client_keys,
            "known_hosts": target.known_hosts,
            "keepalive_interval": limits.keepalive_interval,
            "keepalive_count_max": limits.keepalive_count_max,
            "connect_timeout": limits.connect_timeout,
            # Only what the Target says: no agent, no ~/.ssh/config, no passwords.
            "agent_path": None,
            "config": None,
            "preferred_auth": "publickey",
            "password": None,
            "encryption_algs": list(ENCRYPTION_ALGS),
            "tunnel": _Connector(stages),
        }
        try:
            conn = await asyncssh.connect(
                target.host, target.port, client_factory=lambda: client, **options
            )
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            raise translate.connect_error(exc, target, _connect_table) from exc
        return AsyncsshConnection(conn, client)
