"""The paramiko backend: paramiko's blocking API run in threads of this backend's own.

paramiko runs one reader thread per Transport. Every blocking call of ours (connect, and each exec
from channel open to exit status) runs in this backend's thread pool, never on the event loop and
never in asyncio's small default executor. A running exec holds one thread; the pool's channel
cap bounds how many run at once, MAX_THREADS bounds them whatever the caller does.

What paramiko does not do and this module adds:
- TCP_NODELAY: without it each exec waits on Nagle's algorithm (tens of milliseconds a
  command; docs/benchmarks.md, "Figures behind the code").
- Dead peer detection: paramiko's keepalive wants no reply, so it cannot notice a silent peer.
  We send a want-reply global request after keepalive_interval without sending anything, and
  declare the peer dead after keepalive_count_max + 1 intervals without receiving anything, as
  asyncssh does (translate.peer_dead).
- exit-signal: paramiko drops it; we keep the signal name.
- The SSH signal request on cancel.
- No EOF or signal request after paramiko's automatic answer to sshd's CLOSE: sshd drops the
  whole connection for a message about a channel it has freed.
- SFTP (`sftp()`): paramiko's SFTPClient, each call in this backend's threads and never two at
  once on one session (a per-session asyncio lock), on a channel opened with the receive window
  the caller asks for (`sftp_window`: the transfer lane sizes it from the bandwidth-delay
  product); reads and writes pipelined by this module (paramiko's readv and prefetch run
  threads of their own that fail unseen when the connection drops; its pipelined writes send
  32 KiB requests and wait for every answer after a hundred), as many bytes in flight as the
  window; ENOSPC told apart by statvfs@openssh.com.

Every paramiko and socket error is translated into sshpool.errors in this module (its table) and
in `sshpool.backends.translate` (the shared rules).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import errno
import io
import os
import select
import socket
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from sshpool import tracing
from sshpool.backends import translate
from sshpool.backends.base import DirEntry, Exit, FileAttrs, realpaths_in_turn
from sshpool.command import Capture, Stdin
from sshpool.errors import (
    AuthenticationFailed,
    ChannelRefused,
    ConnectionLost,
    ConnectTimeout,
    HostKeyMismatch,
    RemoteFileError,
    SSHPoolError,
)
from sshpool.target import Limits, Target

T = TypeVar("T")

try:
    import paramiko
    from paramiko.common import MSG_CHANNEL_REQUEST, cMSG_CHANNEL_REQUEST, cMSG_GLOBAL_REQUEST
except ImportError as exc:
    raise ImportError(
        "the paramiko SSH backend needs paramiko: pip install 'sshapi[paramiko]'"
    ) from exc

# Threads this backend may use at once: one per running exec, plus connects and closes.
MAX_THREADS = 128
# Bytes read from a channel at a time, and chunks handed to the event loop but not yet consumed
# (so a fast command cannot fill memory faster than the loop drains it).
CHUNK = 1 << 16
MAX_IN_FLIGHT = 16
# How often an exec thread looks up from waiting for output: for cancellation, a dead peer, and
# (shorter) for window space while stdin is still being sent.
POLL = 0.05
POLL_STDIN = 0.005
# How long a cancelled exec waits for its thread to send TERM and close the channel.
CANCEL_GRACE = 2.0


def _connect_table(exc: BaseException, target: Target) -> SSHPoolError | None:
    """paramiko's exceptions in our tree; the shared rules (translate.connect_error) do the rest."""
    if isinstance(exc, paramiko.AuthenticationException):
        return AuthenticationFailed(f"{target}: no client key accepted: {exc}")
    if isinstance(exc, paramiko.SSHException) and "protocol banner" in str(exc):
        # paramiko's word for a connection closed before sshd's banner (MaxStartups).
        return translate.dropped(target, exc)
    return None


class _WatchedSocket(socket.socket):
    """A socket that remembers when it last received anything: silence on it for too long is
    the only sign of a dead peer that paramiko leaves us."""

    last_recv = 0.0

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        self.last_recv = time.monotonic()
        return data


def _handle_channel_request(chan: Any, m: Any) -> None:
    """paramiko's channel request handler, plus the exit-signal that paramiko ignores."""
    start = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()  # want_reply: always false for exit-signal
        chan.sshpool_exit_signal = m.get_text()
        chan.status_event.set()
    m.packet.seek(start)
    paramiko.Channel._handle_request(chan, m)


class _Transport(paramiko.Transport):  # type: ignore[misc]
    _channel_handler_table: ClassVar[dict[int, Any]] = {
        **paramiko.Transport._channel_handler_table,
        MSG_CHANNEL_REQUEST: _handle_channel_request,
    }


def _open_socket(host: str, port: int, deadline: float) -> _WatchedSocket:
    error: OSError = ConnectionRefusedError(f"no address for {host}")
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = _WatchedSocket(family, kind, proto)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(addr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.last_recv = time.monotonic()
        return sock
    raise error


def _connect_blocking(target: Target, deadline: float) -> tuple[Any, _WatchedSocket]:
    """Connect, verify the host key, authenticate; in a thread. Raises sshpool errors only."""
    name = translate.known_host_name(target)
    sock: _WatchedSocket | None = None
    transport: Any = None
    try:
        try:
            host_keys = _host_keys(target.known_hosts)
        except OSError as exc:
            raise translate.unreadable_known_hosts(target, exc) from exc
        known = host_keys.lookup(name)
        if not known:
            raise translate.unknown_host(target)
        stages = tracing.stages()  # the connect's trace (sshpool.tracing); this thread's copy
        began = time.time_ns()
        sock = _open_socket(target.host, target.port, deadline)
        if stages is not None:
            stages.mark("connect", began)
        transport = _Transport(sock)
        remaining = max(0.001, deadline - time.monotonic())
        transport.banner_timeout = transport.handshake_timeout = remaining
        options = transport.get_security_options()
        options.key_types = translate.hostkey_preference(options.key_types, known.keys())
        transport.start_client(timeout=remaining)
        if not transport.initial_kex_done:
            raise ConnectTimeout(f"{target}: no key exchange within {remaining:.1f} s")
        if stages is not None:
            stages.mark("key_exchange")
        key = transport.get_remote_server_key()
        if not host_keys.check(name, key):
            raise HostKeyMismatch(
                f"{target}: {key.get_name()} host key {key.fingerprint} is not the one in "
                f"{target.known_hosts}"
            )
        _authenticate(transport, target, deadline)
        if stages is not None:
            stages.mark("authentication")
        return transport, sock
    except BaseException as exc:
        if transport is not None:
            transport.close()
        if sock is not None:
            sock.close()
        if isinstance(exc, SSHPoolError) or not isinstance(exc, Exception):
            raise
        timed_out = time.monotonic() >= deadline
        raise translate.connect_error(exc, target, _connect_table, timed_out=timed_out) from exc


def _host_keys(path: str) -> Any:
    """known_hosts as paramiko's HostKeys, without its marker lines (@cert-authority,
    @revoked): paramiko's own loader fails on the whole file for one, and cannot check a
    host certificate anyway, so such a line vouches for no key here (a host it alone covers
    gets HostKeyMismatch)."""
    host_keys = paramiko.HostKeys()
    with open(path) as f:
        for line in f:
            if not line.strip() or line.lstrip().startswith(("#", "@")):
                continue
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
            if entry is not None and entry.key is not None:
                for name in entry.hostnames:
                    host_keys.add(name, entry.key.get_name(), entry.key)
    return host_keys


def _keys(target: Target) -> Iterator[tuple[str, Any]]:
    """(name, paramiko key) of each key to offer, in order; a key file that cannot be loaded is
    (name, the reason). A certificate login is its one fresh key, loaded from memory."""
    creds = target.credentials()
    if creds is not None:
        key = paramiko.Ed25519Key.from_private_key(io.StringIO(creds.private_key.decode()))
        key.load_certificate(creds.certificate.decode())
        yield f"certificate {creds.key_id}", key
        return
    for path in target.client_keys:
        try:
            yield path, paramiko.PKey.from_path(path)
        except (OSError, paramiko.SSHException, ValueError) as exc:
            yield path, f"cannot load: {exc}"


def _authenticate(transport: Any, target: Target, deadline: float) -> None:
    refused: list[str] = []
    for path, key in _keys(target):
        if isinstance(key, str):
            refused.append(f"{path}: {key}")
            continue
        transport.auth_timeout = max(0.001, deadline - time.monotonic())
        try:
            transport.auth_publickey(target.username, key)
        except paramiko.AuthenticationException as exc:
            refused.append(f"{path}: {exc}")
            continue
        if transport.is_authenticated():
            return
    raise AuthenticationFailed(f"{target}: no client key accepted ({'; '.join(refused)})")


class _Relay:
    """Hands output from an exec thread to the event loop, where the captures live, with at most
    MAX_IN_FLIGHT chunks not yet consumed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel: threading.Event) -> None:
        self.loop = loop
        self._cancel = cancel
        self._room = threading.Semaphore(MAX_IN_FLIGHT)

    def put(self, capture: Capture, data: bytes) -> bool:
        """In the exec thread: queue `data` for `capture`; False once the exec is cancelled."""
        while not self._room.acquire(timeout=POLL):
            if self._cancel.is_set():
                return False
        self.loop.call_soon_threadsafe(self._feed, capture, data)
        return True

    def _feed(self, capture: Capture, data: bytes) -> None:
        self._room.release()
        if not self._cancel.is_set():
            capture.feed(data)


def _signal_message(chan: Any, name: str) -> Any:
    """The SSH "signal" channel request, which paramiko has no method for."""
    m = paramiko.Message()
    m.add_byte(cMSG_CHANNEL_REQUEST)
    m.add_int(chan.remote_chanid)
    m.add_string("signal")
    m.add_boolean(False)
    m.add_string(name)
    return m


class _Waker:
    """A pipe that wakes a pump thread's select when its Stdin is written to (called on the
    event loop, as is `close`)."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def __call__(self) -> None:
        if not self._closed:
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes the thread already
                os.write(self._w, b"x")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 4096)

    def close(self) -> None:
        self._closed = True
        os.close(self.fd)
        os.close(self._w)


def _send_while_open(chan: Any, message: Callable[[], Any]) -> None:
    """Send message() about `chan` unless the channel is closed, holding its lock while sending.

    paramiko answers the remote CLOSE with its own, from the transport thread. A message of ours
    sent after that reaches sshd for a channel it has freed, and sshd drops the whole connection
    ("ieof packet referred to nonexistent channel"): paramiko's shutdown_write releases the lock
    before sending, hence this. The lock is not taken while a key exchange is on, which needs
    the transport thread (that may want the lock) to finish.
    """
    transport = chan.transport
    while not transport.clear_to_send.is_set() and transport.is_active():
        transport.clear_to_send.wait(POLL)
    with chan.lock:
        if chan.closed:
            return
        m = message()
        if m is not None:
            transport._send_user_message(m)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: nobody awaits an abandoned thread's result."""
    if not fut.cancelled():
        fut.exception()


# paramiko raises IOError with these errnos for the SFTP statuses it knows (paramiko.sftp_client
# _convert_status), a bare IOError(text) for the rest.
_SFTP_ERRNO = {errno.ENOENT: 2, errno.EACCES: 3}


def _sftp_error(exc: BaseException, path: str | None) -> SSHPoolError:
    """paramiko's SFTP errors in our tree."""
    status = (
        isinstance(exc, OSError)
        and not isinstance(exc, (ConnectionError, TimeoutError))
        and (exc.errno in _SFTP_ERRNO or (exc.errno is None and bool(exc.args)))
    )
    if status:
        assert isinstance(exc, OSError)
        text = exc.strerror or " ".join(str(a) for a in exc.args)
        return translate.sftp_error(_SFTP_ERRNO.get(exc.errno or 0, 4), text, path)
    return ConnectionLost(f"connection lost during SFTP: {translate.describe(exc)}", started=True)


def _attrs(a: Any) -> FileAttrs:
    return FileAttrs.from_mode(a.st_mode, a.st_size, a.st_mtime)


class _Confined:
    """One paramiko object used from this backend's threads, one call at a time."""

    def __init__(self, executor: ThreadPoolExecutor, alive: Callable[[], bool]) -> None:
        self._executor = executor
        self._alive = alive
        self._lock = asyncio.Lock()

    async def call(self, path: str | None, fn: Callable[..., T], *args: Any) -> T:
        async with self._lock:
            fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            try:
                # Shielded: the lock stays held until the thread is done with the object.
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                fut.add_done_callback(_retrieve)
                await asyncio.wait([fut])
                raise
            except (OSError, EOFError, paramiko.SSHException) as exc:
                if not self._alive():
                    # paramiko words a dropped channel as a plain IOError now and then.
                    message = f"connection lost during SFTP: {translate.describe(exc)}"
                    raise ConnectionLost(message, started=True) from exc
                raise _sftp_error(exc, path) from exc


def _free_bytes(sftp: Any, path: str) -> int | None:
    """statvfs@openssh.com (paramiko has no method for it): f_bavail x f_frsize, or None."""
    try:
        t, msg = sftp._request(paramiko.sftp.CMD_EXTENDED, "statvfs@openssh.com", path)
    except Exception:
        return None
    if t != paramiko.sftp.CMD_EXTENDED_REPLY:
        return None
    bsize, frsize, _blocks, _bfree, bavail = (msg.get_int64() for _ in range(5))
    return int(bavail * (frsize or bsize))


# A directory read one READDIR at a time: paramiko's listdir_attr reads it whole, and its
# listdir_iter keeps 50 requests in flight (their replies outlive a caller that stops early).
def _opendir(sftp: Any, path: str) -> bytes:
    t, msg = sftp._request(paramiko.sftp.CMD_OPENDIR, path)
    if t != paramiko.sftp.CMD_HANDLE:
        raise paramiko.SFTPError("Expected handle")
    handle: bytes = msg.get_binary()
    return handle


def _readdir(sftp: Any, handle: bytes) -> list[Any] | None:
    """One READDIR's entries (SFTPAttributes with `filename`), None at the end."""
    try:
        t, msg = sftp._request(paramiko.sftp.CMD_READDIR, handle)
    except EOFError:  # paramiko's word for the SSH_FX_EOF status
        return None
    if t != paramiko.sftp.CMD_NAME:
        raise paramiko.SFTPError("Expected name response")
    entries = []
    for _ in range(msg.get_int()):
        filename = msg.get_text()
        longname = msg.get_text()
        entries.append(paramiko.SFTPAttributes._from_msg(msg, filename, longname))
    return entries


def _closedir(sftp: Any, handle: bytes) -> None:
    sftp._request(paramiko.sftp.CMD_CLOSE, handle)


# Our reads and writes keep several SFTP requests of BLOCK bytes in flight (what OpenSSH's
# sftp-server answers at most per read and takes per write, 255 KiB): paramiko's own read sends
# one 32 KiB request and waits for its answer before the next, one round trip per 32 KiB (24
# MB/s on loopback, under 2 MB/s at 20 ms); its readv and prefetch pipeline in threads of
# their own that fail unseen when the connection drops. In flight: as many bytes as the
# session's receive window (more would wait for it anyway), at least MIN_DEPTH requests
# (16 x 255 KiB: a 4 MiB chunk in one go, as on loopback before).
BLOCK = 255 * 1024
MIN_DEPTH = 16


def _depth(window: int) -> int:
    """Requests in flight for a session whose channel has `window` bytes of receive window."""
    return max(MIN_DEPTH, window // BLOCK)


def _read_pipelined(f: Any, size: int, depth: int) -> bytes:
    """Up to `size` bytes of paramiko's SFTPFile `f` from its position, `depth` requests in
    flight (in this backend's thread, one call at a time on the session: `_Confined`). The
    server answers in order; a short answer or an EOF status (the end of the file) ends the
    call once the requests still in flight are answered, so the session's stream stays in
    step. A channel that closed (paramiko's EOFError too) raises: nothing to keep in step."""
    sftp = f.sftp
    chan = sftp.sock
    start = f.tell()
    asked = start
    end = start + size
    parts: list[bytes] = []
    pending: collections.deque[tuple[int, int]] = collections.deque()
    while True:
        while len(pending) < depth and asked < end:
            n = min(BLOCK, end - asked)
            num = sftp._async_request(
                type(None), paramiko.sftp.CMD_READ, f.handle, paramiko.sftp.int64(asked), n
            )
            pending.append((num, n))
            asked += n
        if not pending:
            break
        num, n = pending.popleft()
        try:
            t, msg = sftp._read_response(num)
        except EOFError:
            if chan.closed or not chan.get_transport().is_active():
                raise
            break  # the SFTP status EOF: nothing at that offset
        except paramiko.SFTPError:
            _drain(sftp, pending)
            raise
        if t != paramiko.sftp.CMD_DATA:
            _drain(sftp, pending)
            raise paramiko.SFTPError("Expected data")
        data = msg.get_string()
        parts.append(data)
        if len(data) < n:
            break
    _drain(sftp, pending)
    data = b"".join(parts)
    f.seek(start + len(data))
    return data


def _drain(sftp: Any, pending: collections.deque[tuple[int, int]]) -> None:
    """Read and drop the answers of requests still in flight, in order."""
    for num, _ in pending:
        with contextlib.suppress(EOFError, paramiko.SFTPError):
            sftp._read_response(num)
    pending.clear()


class _Writes:
    """A written file's requests not yet answered, kept between calls: a write call returns
    once its last request is sent, and the next call's requests go out behind them (on a long
    path the pipe does not empty between two calls). Registered under paramiko's SFTPFile, so
    that an answer another call of the session reads first lands in its `_async_response`
    (an error status saved there) instead of being dropped."""

    def __init__(self, f: Any, depth: int, offset: int = 0) -> None:
        self.f = f
        self.depth = depth
        self.offset = offset  # where the next request writes
        self.pending: collections.deque[int] = collections.deque()

    def write(self, data: bytes) -> None:
        """In this backend's thread: send `data` as requests of BLOCK bytes at the file's
        offset, with at most `depth` unanswered (the oldest waited for first)."""
        f = self.f
        for pos in range(0, len(data), BLOCK):
            while len(self.pending) >= self.depth:
                self._settle_one()
            block = data[pos : pos + BLOCK]
            num = f.sftp._async_request(
                f, paramiko.sftp.CMD_WRITE, f.handle, paramiko.sftp.int64(self.offset), block
            )
            self.pending.append(num)
            self.offset += len(block)
        f._check_exception()

    def _settle_one(self) -> None:
        num = self.pending.popleft()
        if num in self.f.sftp._expecting:  # else read by another call: its status saved
            self.f.sftp._read_response(num)  # an error status raises (IOError)
        self.f._check_exception()

    def flush(self) -> None:
        while self.pending:
            self._settle_one()


class ParamikoFile:
    def __init__(
        self, confined: _Confined, sftp: Any, f: Any, path: str, depth: int, offset: int = 0
    ) -> None:
        self._c = confined
        self._sftp = sftp
        self._f = f
        self._path = path
        self._depth = depth
        self._writes = _Writes(f, depth, offset)
        self._closed = False

    async def read(self, size: int) -> bytes:
        data: bytes = await self._c.call(self._path, _read_pipelined, self._f, size, self._depth)
        return data

    async def write(self, data: bytes) -> None:
        try:
            await self._c.call(self._path, self._writes.write, data)
        except RemoteFileError as exc:
            raise await self._why(exc) from exc

    async def flush(self) -> None:
        try:
            await self._c.call(self._path, self._writes.flush)
        except RemoteFileError as exc:
            raise await self._why(exc) from exc

    async def _why(self, exc: RemoteFileError) -> RemoteFileError:
        free = await self._c.call(None, _free_bytes, self._sftp, self._path)
        return translate.write_failed(exc, free)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.flush()
        finally:
            try:
                await self._c.call(self._path, self._f.close)
            except RemoteFileError as exc:
                raise await self._why(exc) from exc


class ParamikoSFTP:
    def __init__(self, sftp: Any, executor: ThreadPoolExecutor) -> None:
        self._sftp = sftp
        chan = sftp.get_channel()
        self._c = _Confined(executor, lambda: not chan.closed and chan.get_transport().is_active())
        self._depth = _depth(chan.in_window_size)
        self._closed = False

    def receive_window(self) -> int:
        """The receive window its channel was opened with (what sshd may send unanswered)."""
        window: int = self._sftp.get_channel().in_window_size
        return window

    async def realpath(self, path: str) -> str:
        result: str = await self._c.call(path, self._sftp.normalize, path)
        return result

    async def realpaths(self, paths: Sequence[str]) -> list[str | None]:
        return await realpaths_in_turn(self, paths)

    async def stat(self, path: str) -> FileAttrs:
        return _attrs(await self._c.call(path, self._sftp.stat, path))

    async def lstat(self, path: str) -> FileAttrs:
        return _attrs(await self._c.call(path, self._sftp.lstat, path))

    async def readlink(self, path: str) -> str:
        result = await self._c.call(path, self._sftp.readlink, path)
        if result is None:
            raise translate.sftp_error(4, "not a symlink", path)
        return str(result)

    async def listdir(self, path: str) -> list[DirEntry]:
        names = await self._c.call(path, self._sftp.listdir_attr, path)
        return [DirEntry(a.filename, _attrs(a)) for a in names if a.filename not in (".", "..")]

    async def scandir(self, path: str) -> AsyncGenerator[DirEntry, None]:
        handle = await self._c.call(path, _opendir, self._sftp, path)
        try:
            while True:
                batch = await self._c.call(path, _readdir, self._sftp, handle)
                if batch is None:
                    break
                for a in batch:
                    if a.filename not in (".", ".."):
                        yield DirEntry(a.filename, _attrs(a))
        finally:
            # Closed early too (the caller stopped); a session that broke meanwhile is dropped
            # with its handles.
            with contextlib.suppress(SSHPoolError):
                await self._c.call(path, _closedir, self._sftp, handle)

    def _open_read_blocking(self, path: str, offset: int) -> Any:
        f = self._sftp.open(path, "rb")
        f.seek(offset)
        return f

    async def open_read(self, path: str, offset: int = 0) -> ParamikoFile:
        f = await self._c.call(path, self._open_read_blocking, path, offset)
        return ParamikoFile(self._c, self._sftp, f, path, self._depth)

    def _open_write_blocking(self, path: str, exclusive: bool, mode: int) -> Any:
        f = self._sftp.open(path, "wxb" if exclusive else "wb")
        f.chmod(mode)
        return f

    async def open_write(
        self, path: str, *, exclusive: bool = True, mode: int = 0o644
    ) -> ParamikoFile:
        f = await self._c.call(path, self._open_write_blocking, path, exclusive, mode)
        return ParamikoFile(self._c, self._sftp, f, path, self._depth)

    def _open_resume_blocking(self, path: str) -> Any:
        return self._sftp.open(path, "r+b")  # READ|WRITE: no CREAT, no TRUNC

    async def open_resume(self, path: str, offset: int) -> ParamikoFile:
        f = await self._c.call(path, self._open_resume_blocking, path)
        return ParamikoFile(self._c, self._sftp, f, path, self._depth, offset)

    async def rename(self, old: str, new: str, *, overwrite: bool) -> None:
        fn = self._sftp.posix_rename if overwrite else self._sftp.rename
        await self._c.call(old, fn, old, new)

    async def remove(self, path: str) -> None:
        await self._c.call(path, self._sftp.remove, path)

    async def rmdir(self, path: str) -> None:
        await self._c.call(path, self._sftp.rmdir, path)

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        await self._c.call(path, self._sftp.mkdir, path, mode)

    async def setstat(
        self, path: str, *, mode: int | None = None, mtime: int | None = None
    ) -> None:
        if mode is not None:
            await self._c.call(path, self._sftp.chmod, path, mode)
        if mtime is not None:
            await self._c.call(path, self._sftp.utime, path, (mtime, mtime))

    def intact(self) -> bool:
        # A cancelled call waits for its thread to finish with the object (_Confined.call):
        # nothing is left half-done on the transport.
        return True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await self._c.call(None, self._sftp.close)


class ParamikoConnection:
    def __init__(
        self, transport: Any, sock: _WatchedSocket, limits: Limits, executor: ThreadPoolExecutor
    ) -> None:
        self._transport = transport
        self._sock = sock
        self._executor = executor
        self._closed = False
        self._limits = limits
        # The receive window of the next SFTP sessions' channels (None: paramiko's 2 MiB): the
        # transfer lane sizes it from the bandwidth-delay product (sshpool.lane, `wan_sizes`).
        # The maximum packet stays paramiko's 32 KiB: sshd reads at most 32 KiB of
        # sftp-server's output per pass and sends it as it comes, so a bigger maximum
        # would change nothing.
        self.sftp_window: int | None = None
        interval = limits.keepalive_interval
        if interval > 0:
            transport.packetizer.set_keepalive(interval, self._keepalive)

    def _silent_too_long(self) -> bool:
        return translate.peer_dead(self._limits, time.monotonic() - self._sock.last_recv)

    def _keepalive(self) -> None:
        """In paramiko's transport thread, after keepalive_interval without sending."""
        if self._silent_too_long():
            self._transport.close()
            return
        m = paramiko.Message()
        m.add_byte(cMSG_GLOBAL_REQUEST)
        m.add_string("keepalive@openssh.com")
        m.add_boolean(True)  # sshd answers (with a failure): that answer is the sign of life
        self._transport._send_user_message(m)

    def is_alive(self) -> bool:
        return not self._closed and self._transport.is_active() and not self._silent_too_long()

    async def exec(
        self, command: str, stdin: bytes | Stdin | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        relay = _Relay(loop, cancel)
        fut = loop.run_in_executor(
            self._executor, self._exec_blocking, command, stdin, stdout, stderr, relay, cancel
        )
        try:
            # Shielded: cancelling must not abandon the thread before it has closed the channel.
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel.set()
            fut.add_done_callback(_retrieve)
            await asyncio.wait([fut], timeout=CANCEL_GRACE)
            raise

    def _open_channel(self, window: int | None = None) -> Any:
        """A new session channel (an exec's or an SFTP session's; in the executor), with
        paramiko's receive window or `window` bytes: refused while the transport lives, lost
        with it otherwise."""
        try:
            return self._transport.open_session(window_size=window)
        except paramiko.ChannelException as exc:
            # MaxSessions: "open failed" (code 2) on OpenSSH 9, code 1 on older sshd.
            raise ChannelRefused(f"channel refused: {exc.text} (code {exc.code})") from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if self.is_alive():
                # paramiko keeps one saved exception per transport: when two opens fail at once,
                # the second sees a bare SSHException instead of its ChannelException.
                raise ChannelRefused(f"channel refused: {exc}") from exc
            raise ConnectionLost(f"cannot open a channel: {exc}", started=False) from exc

    def _exec_blocking(
        self,
        command: str,
        stdin: bytes | Stdin | None,
        stdout: Capture,
        stderr: Capture,
        relay: _Relay,
        cancel: threading.Event,
    ) -> Exit:
        if cancel.is_set():
            raise ConnectionLost("cancelled before start", started=False)
        chan = self._open_channel()
        try:
            return self._run(chan, command, stdin, stdout, stderr, relay, cancel)
        finally:
            with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
                chan.close()

    def _run(
        self,
        chan: Any,
        command: str,
        stdin: bytes | Stdin | None,
        stdout: Capture,
        stderr: Capture,
        relay: _Relay,
        cancel: threading.Event,
    ) -> Exit:
        try:
            chan.exec_command(command)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if self._transport.is_active():
                raise ChannelRefused(f"exec request refused: {exc}") from exc
            raise ConnectionLost(f"connection lost at exec: {exc}", started=True) from exc
        try:
            return self._pump(chan, stdin, stdout, stderr, relay, cancel)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectionLost(f"connection lost while running: {exc}", started=True) from exc

    def _pump(
        self,
        chan: Any,
        stdin: bytes | Stdin | None,
        stdout: Capture,
        stderr: Capture,
        relay: _Relay,
        cancel: threading.Event,
    ) -> Exit:
        """Write stdin then EOF while reading stdout and stderr, until the exit status. A Stdin
        is sent as it is written to (a pipe wakes this thread), EOF once it is closed."""
        feed = stdin if isinstance(stdin, Stdin) else None
        pending = memoryview(stdin if isinstance(stdin, bytes) else b"")
        eof_due, eof_sent = feed is None, False
        waker = None
        if feed is not None:
            waker = _Waker()
            feed.subscribe(waker)
        try:
            return self._pump_loop(
                chan, feed, pending, eof_due, eof_sent, waker, stdout, stderr, relay, cancel
            )
        finally:
            if waker is not None:
                # On the loop, where the Stdin calls it: no poke can hit a closed descriptor.
                relay.loop.call_soon_threadsafe(waker.close)

    def _pump_loop(
        self,
        chan: Any,
        feed: Stdin | None,
        pending: memoryview,
        eof_due: bool,
        eof_sent: bool,
        waker: _Waker | None,
        stdout: Capture,
        stderr: Capture,
        relay: _Relay,
        cancel: threading.Event,
    ) -> Exit:
        ready = chan.fileno()  # readable whenever stdout or stderr has data, or on close
        watched = [ready] if waker is None else [ready, waker.fd]
        while True:
            busy = False
            while chan.recv_ready():
                busy = relay.put(stdout, chan.recv(CHUNK))
            while chan.recv_stderr_ready():
                busy = relay.put(stderr, chan.recv_stderr(CHUNK))
            if feed is not None and not pending and not eof_sent:
                data, eof_due = feed.take(CHUNK * 16)
                pending = memoryview(data)
            if pending and chan.send_ready():
                try:
                    pending = pending[chan.send(pending[:CHUNK]) :]
                except OSError:
                    if not chan.closed:
                        raise
                    pending = pending[:0]  # the command ended without reading all its stdin
                busy = True
            if not pending and eof_due and not eof_sent:
                _send_while_open(chan, chan._send_eof)
                eof_sent = True
            if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                if chan.recv_ready() or chan.recv_stderr_ready():
                    continue
                break
            if cancel.is_set():
                # Best effort: sshd delivers it to the login shell only; the pool kills the
                # process group.
                _send_while_open(chan, lambda: _signal_message(chan, "TERM"))
                raise ConnectionLost("cancelled", started=True)
            if not self.is_alive():
                raise ConnectionLost("connection lost while running", started=True)
            if busy:
                continue
            if chan.eof_received:
                # The readiness pipe stays readable after EOF: wait for the exit status.
                chan.status_event.wait(POLL)
            else:
                readable, _, _ = select.select(watched, [], [], POLL_STDIN if pending else POLL)
                if waker is not None and waker.fd in readable:
                    waker.drain()
        signal = getattr(chan, "sshpool_exit_signal", None)
        if signal is not None:
            return Exit(status=-1, signal=signal)
        if chan.exit_status >= 0:
            return Exit(status=chan.exit_status)
        if not self._transport.is_active():
            raise ConnectionLost("connection lost before the exit status", started=True)
        return Exit(status=None)

    def _sftp_blocking(self) -> Any:
        chan = self._open_channel(self.sftp_window)
        try:
            chan.invoke_subsystem("sftp")
            return paramiko.SFTPClient(chan)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            with contextlib.suppress(Exception):
                chan.close()
            if not self._transport.is_active():
                raise ConnectionLost(f"cannot start SFTP: {exc}", started=False) from exc
            raise translate.sftp_error(4, f"no SFTP subsystem: {exc}", None) from exc

    async def sftp(self) -> ParamikoSFTP:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, self._sftp_blocking)
        try:
            client = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._close_sftp_late)
            raise
        return ParamikoSFTP(client, self._executor)

    def _close_sftp_late(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._executor.submit(fut.result().close)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            # Transport.close joins paramiko's thread: blocking, so not on the loop.
            await loop.run_in_executor(self._executor, self._transport.close)
        self._sock.close()


class ParamikoBackend:
    name = "paramiko"

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="sshpool-paramiko")

    async def connect(self, target: Target) -> ParamikoConnection:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + target.limits.connect_timeout
        # In a copy of this context: the connect's stage stamps (sshpool.tracing) reach the thread.
        run = contextvars.copy_context().run
        fut = loop.run_in_executor(self._executor, run, _connect_blocking, target, deadline)
        try:
            transport, sock = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._close_late)
            raise
        return ParamikoConnection(transport, sock, target.limits, self._executor)

    def _close_late(self, fut: asyncio.Future[tuple[Any, _WatchedSocket]]) -> None:
        """A connect whose caller gave up still finishes in its thread: close what it made."""
        if fut.cancelled() or fut.exception() is not None:
            return
        transport, sock = fut.result()
        # Transport.close joins paramiko's thread: not on the event loop.
        self._executor.submit(transport.close).add_done_callback(lambda _: sock.close())
