"""The ssh2-python (libssh2) backend: one non-blocking libssh2 session driven from the event loop.

libssh2 sessions are not thread-safe, so a session is only ever touched from the event loop's
thread, in non-blocking mode: each call either does its work or returns EAGAIN, and the caller
then waits for the socket (`loop.add_reader` / `add_writer`, in the direction libssh2 says it is
blocked on) and tries again. Many channels share the session that way, each exec in its own
coroutine.

What makes this subtle, and how it is handled:
- Any libssh2 call reads whatever packets have arrived, for every channel. A call for channel B
  may read the packet that channel A waits for; A would then wait for a socket that stays quiet.
  So a call that found input waiting in the kernel wakes every waiter, and every waiter also
  wakes at least each FALLBACK seconds.
- Only one packet can be half sent: a call that returned EAGAIN after starting to send must be
  repeated until it finishes, or the session's output is stuck. When an exec fails or is
  cancelled with such a call in flight, a background task finishes it before closing.
- libssh2 cannot read without a channel: an idle connection is probed (a session channel opened
  and closed) when input arrives (sshd's own keepalives, a disconnect) and after
  keepalive_interval of silence. The answer proves the peer alive; none for
  keepalive_count_max + 1 intervals declares it dead, as asyncssh does.
- Freeing a libssh2 session still writes to its socket, so libssh2 gets its own duplicate of the
  descriptor, closed only after the session is freed: a reused descriptor number can never
  receive those bytes.

SFTP (`sftp()`) is libssh2's, on a channel of the same session, driven the same way. ssh2-python
wraps neither readlink nor posix-rename (SFTP v3 rename never replaces), and its close calls
cannot be repeated after EAGAIN: those few libssh2 calls are made through ctypes on the libssh2
ssh2-python loaded, with the SFTP and handle pointers read from its objects after checking their
layout (`sshpool.backends.ssh2_extras`). Without them, `sftp()` raises RemoteUnsupported (the
API's 501).

Limitation: ssh2-python's get_exit_signal loses the signal name, so a command whose shell was
killed by a signal reports exit status 0 and no signal (libssh2's default) with this backend.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import functools
import hashlib
import hmac
import os
import re
import select
import socket
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from sshpool import tracing
from sshpool.backends import translate
from sshpool.backends.base import DirEntry, Exit, FileAttrs, realpaths_in_turn
from sshpool.backends.ssh2_extras import READLINK, forget_pointer, lib_pointer, load_extras
from sshpool.backends.translate import describe
from sshpool.command import Capture, Stdin
from sshpool.errors import (
    AuthenticationFailed,
    ChannelRefused,
    ConnectError,
    ConnectionLost,
    HostKeyMismatch,
    RemoteFileError,
    RemoteFileFailure,
    RemoteUnsupported,
    SSHPoolError,
)
from sshpool.target import Limits, Target

try:
    from ssh2 import exceptions as ssh2_errors
    from ssh2.error_codes import LIBSSH2_ERROR_EAGAIN
    from ssh2.knownhost import LIBSSH2_KNOWNHOST_KEYENC_RAW, LIBSSH2_KNOWNHOST_TYPE_PLAIN
    from ssh2.session import (
        LIBSSH2_METHOD_HOSTKEY,
        LIBSSH2_SESSION_BLOCK_OUTBOUND,
        Session,
    )
    from ssh2.sftp import (
        LIBSSH2_FXF_CREAT,
        LIBSSH2_FXF_EXCL,
        LIBSSH2_FXF_READ,
        LIBSSH2_FXF_TRUNC,
        LIBSSH2_FXF_WRITE,
        LIBSSH2_SFTP_ATTR_ACMODTIME,
        LIBSSH2_SFTP_ATTR_PERMISSIONS,
    )
    from ssh2.sftp_handle import SFTPAttributes
except ImportError as exc:
    raise ImportError("the ssh2 SSH backend needs ssh2-python: pip install 'sshapi[ssh2]'") from exc

T = TypeVar("T")

# libssh2's calls ssh2-python lacks (SFTP readlink, posix-rename, repeatable closes): None when
# the libssh2 ssh2-python loaded (just above) has not got them.
_EXTRAS = load_extras()

EAGAIN: int = LIBSSH2_ERROR_EAGAIN
STDERR = 1  # SSH_EXTENDED_DATA_STDERR
CHUNK = 1 << 16
# The longest a waiter sleeps without looking again (see "any libssh2 call reads" above).
FALLBACK = 0.05
# How long a cancelled exec's background task may take to finish libssh2's half-done call and
# send TERM and CLOSE before the connection is given up as stuck.
FINISH_TIMEOUT = 5.0

# Errors about one channel, an SFTP status and a refused key: every other libssh2 error means
# the transport is broken.
_CHANNEL_ERRORS = (ssh2_errors.ChannelError, ssh2_errors.ChannelWindowFullError)
# An SFTP status from the host (or a name too long for the buffer): the session is fine.
_SFTP_ERRORS = (ssh2_errors.SFTPError, ssh2_errors.BufferTooSmallError)
_KEY_ERRORS = (
    ssh2_errors.AuthenticationError,
    ssh2_errors.KeyfileAuthFailedError,
    ssh2_errors.FileError,
    ssh2_errors.PublicKeyError,
)


def _eagain(result: object) -> bool:
    """libssh2 returns EAGAIN alone (int) or first in a (code, data) tuple."""
    if isinstance(result, tuple):
        result = result[0]
    return isinstance(result, int) and result == EAGAIN


class _LibFd:
    """The descriptor libssh2 uses: a duplicate of the connection's socket, closed when the
    libssh2 session holding it is freed (Cython releases it after __dealloc__), because freeing
    a session and its channels still sends on it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


# --------------------------------------------------------------------------------------------
# known_hosts: which key types to ask for (libssh2's knownhost API does the verification)


def _host_matches(patterns: str, name: str) -> bool:
    for pattern in patterns.split(","):
        if pattern.startswith("|1|"):
            salt, _, digest = pattern[3:].partition("|")
            with contextlib.suppress(ValueError):
                mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
                if hmac.compare_digest(mac, base64.b64decode(digest)):
                    return True
        elif not pattern.startswith("!") and _glob(pattern).fullmatch(name):
            return True
    return False


def _glob(pattern: str) -> re.Pattern[str]:
    """known_hosts wildcards are * and ? only: "[host]:port" brackets are literal."""
    parts = (".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile("".join(parts))


def _known_host_lines(target: Target) -> list[str]:
    """The known_hosts lines for the target (plain or hashed names). Marker lines
    (@cert-authority, @revoked) are not supported: they never vouch for a key here."""
    name = translate.known_host_name(target)
    with open(target.known_hosts) as f:
        return [
            line.strip()
            for line in f
            if len(fields := line.split()) >= 3
            and not fields[0].startswith(("#", "@"))
            and _host_matches(fields[0], name)
        ]


# --------------------------------------------------------------------------------------------
# The connection


class _Pending:
    """Calls of one exec that last returned EAGAIN while blocked on sending: a packet may be
    half sent, and only repeating the same call completes it."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}

    def note(self, fn: Callable[..., Any], args: tuple[Any, ...], half_sent: bool) -> None:
        name = getattr(fn, "__name__", repr(fn))
        if half_sent:
            self.calls[name] = (fn, args)
        else:
            self.calls.pop(name, None)


class Ssh2Connection:
    def __init__(self, sock: socket.socket, session: Any, limits: Limits) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._fd = sock.fileno()
        self._session = session
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._failure: str | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._reading = False
        self._writing = False
        self._probing = False
        self._started = False
        # libssh2 opens one channel at a time per session (the open's state is the session's),
        # and whoever calls when the answer is in gets the channel: without a FIFO lock some
        # callers lose that race again and again.
        self._opening = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_recv = time.monotonic()
        self._limits = limits
        self._interval = limits.keepalive_interval

    # ---- waiting for the socket

    def _input_waiting(self) -> bool:
        return bool(self._poll.poll(0))

    def _attempt(self, fn: Callable[..., T], *args: Any, pending: _Pending | None = None) -> T:
        """One non-blocking libssh2 call. Raises ConnectionLost(started=False) once the transport
        is down (callers fix `started`), and libssh2's channel and key errors as they are."""
        if self._failure is not None:
            raise ConnectionLost(self._failure, started=False)
        had_input = self._input_waiting()
        try:
            result = fn(*args)
        except (*_CHANNEL_ERRORS, *_KEY_ERRORS, *_SFTP_ERRORS):
            # An answer came back: nothing of this call is left half sent.
            if pending is not None:
                pending.note(fn, args, False)
            self._wake()
            raise
        except ssh2_errors.SSH2Error as exc:
            self._shutdown(f"connection lost: {describe(exc)}")
            raise ConnectionLost(f"connection lost: {describe(exc)}", started=False) from exc
        if had_input:
            # This call read packets, maybe for other channels: let their waiters look.
            self._last_recv = time.monotonic()
            self._wake()
        again = _eagain(result)
        if pending is not None:
            pending.note(fn, args, again and self._blocked_outbound())
        if not again and not had_input:
            self._wake()
        # A reader that fired was disarmed (level-triggered): watch again for the next input.
        self._watch()
        return result

    def _blocked_outbound(self) -> bool:
        return bool(self._session.block_directions() & LIBSSH2_SESSION_BLOCK_OUTBOUND)

    async def _wait(self) -> None:
        """Sleep until the socket is ready in the direction libssh2 is blocked on, another call
        may have read our packets, or FALLBACK passes."""
        if self._failure is not None:
            return
        if self._blocked_outbound():
            if not self._writing:
                self._loop.add_writer(self._fd, self._on_ready)
                self._writing = True
        else:
            self._watch()
        if self._timer is None:
            self._timer = self._loop.call_later(FALLBACK, self._wake)
        fut = self._loop.create_future()
        self._waiters.append(fut)
        await fut

    async def _call(self, fn: Callable[..., T], *args: Any, pending: _Pending | None = None) -> T:
        """A libssh2 call repeated until it does not return EAGAIN."""
        while True:
            result = self._attempt(fn, *args, pending=pending)
            if not _eagain(result):
                return result
            await self._wait()

    def _watch(self) -> None:
        if not self._reading and self._failure is None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _on_readable(self) -> None:
        # Level-triggered: stop watching until a reader has had a go, or this would spin.
        self._loop.remove_reader(self._fd)
        self._reading = False
        self._last_recv = time.monotonic()
        if self._waiters:
            self._wake()
        elif self._started:
            # Nobody is reading: sshd's keepalive or a disconnect. Let libssh2 handle it.
            self._spawn(self._probe())

    def _on_ready(self) -> None:
        self._loop.remove_writer(self._fd)
        self._writing = False
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- liveness

    def start(self) -> None:
        """The session is authenticated: watch the socket and keep the connection alive."""
        self._started = True
        self._watch()
        if self._interval > 0:
            self._spawn(self._keepalive())

    async def _keepalive(self) -> None:
        while self._failure is None:
            # Half the interval: a probe goes out at most 1.5 intervals into a silence.
            await asyncio.sleep(self._interval / 2)
            silent = time.monotonic() - self._last_recv
            if translate.peer_dead(self._limits, silent):
                self._shutdown(f"no answer from the host for {silent:.1f} s")
                return
            if silent >= self._interval:
                self._spawn(self._probe())

    async def _probe(self) -> None:
        """Open and close a session channel: sshd's answer (open or refused) proves it alive,
        and the calls let libssh2 read and answer whatever arrived meanwhile."""
        if self._probing or self._failure is not None:
            return
        self._probing = True
        try:
            try:
                async with self._opening:
                    chan = await self._call(self._session.open_session)
            except _CHANNEL_ERRORS:
                self._last_recv = time.monotonic()  # refused: an answer all the same
                return
            # The answer may have been read within the call, unseen by the socket watch.
            self._last_recv = time.monotonic()
            await self._call(chan.close)
        except ConnectionLost:
            pass
        finally:
            self._probing = False

    def is_alive(self) -> bool:
        if self._failure is not None:
            return False
        return not translate.peer_dead(self._limits, time.monotonic() - self._last_recv)

    # ---- commands

    async def _open_channel(self, open_: Callable[[], T], pending: _Pending) -> T:
        """`open_` (a session channel's open, or sftp_init's), one open at a time: refused when
        sshd answers it with a failure (MaxSessions: "open failed", code 2)."""
        try:
            async with self._opening:
                return await self._call(open_, pending=pending)
        except ssh2_errors.ChannelFailure as exc:
            raise ChannelRefused(f"channel refused: {describe(exc)}") from exc

    async def exec(
        self, command: str, stdin: bytes | Stdin | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        pending = _Pending()
        chan: Any = None
        started = False
        try:
            chan = await self._open_channel(self._session.open_session, pending)
            started = True
            try:
                await self._call(chan.execute, command, pending=pending)
            except _CHANNEL_ERRORS as exc:
                raise ChannelRefused(f"exec request refused: {describe(exc)}") from exc
            await self._drain(chan, stdin, stdout, stderr, pending)
            await self._call(chan.close, pending=pending)
            # libssh2's close returns after reading any packet: wait for sshd's CLOSE, which
            # comes after the exit status.
            await self._call(chan.wait_closed, pending=pending)
        except BaseException as exc:
            # Refused, lost or cancelled: finish what libssh2 half sent and close the channel
            # in the background; a cancelled command also gets the TERM request.
            cancelled = isinstance(exc, asyncio.CancelledError)
            self._spawn(self._finish(chan, pending, terminate=started and cancelled))
            if isinstance(exc, ConnectionLost):
                raise ConnectionLost(str(exc), started=started) from exc
            if isinstance(exc, _CHANNEL_ERRORS):
                message = f"channel failed: {describe(exc)}"
                raise ConnectionLost(message, started=started) from exc
            raise
        _, signal, _, _ = chan.get_exit_signal()
        if signal:
            return Exit(status=-1, signal=signal.decode(errors="replace"))
        return Exit(status=chan.get_exit_status())

    async def _drain(
        self,
        chan: Any,
        stdin: bytes | Stdin | None,
        stdout: Capture,
        stderr: Capture,
        pending: _Pending,
    ) -> None:
        """Write stdin then EOF while reading stdout and stderr, until the remote EOF. A Stdin
        is sent as it is written to (it wakes this loop), EOF once it is closed."""
        feed = stdin if isinstance(stdin, Stdin) else None
        data = stdin if isinstance(stdin, bytes) else b""
        eof_due = feed is None
        if feed is not None:
            feed.subscribe(self._wake)
        sent = 0
        eof_sent = False
        while True:
            busy = False
            for stream, capture in ((0, stdout), (STDERR, stderr)):
                while True:
                    size, chunk = self._attempt(chan.read_ex, CHUNK, stream, pending=pending)
                    if size <= 0:
                        break
                    capture.feed(chunk)
                    busy = True
            if chan.eof():  # remote EOF, and nothing left queued for this channel
                await self._flush_pending(pending)
                return
            if feed is not None and sent == len(data) and not eof_sent:
                data, eof_due = feed.take(CHUNK * 16)
                sent = 0
            if sent < len(data):
                # After EAGAIN the same offset must be offered again (see _Pending).
                _, written = self._attempt(chan.write, data[sent : sent + CHUNK], pending=pending)
                sent += written
                busy = busy or written > 0
            elif eof_due and not eof_sent:
                eof_sent = not _eagain(self._attempt(chan.send_eof, pending=pending))
                busy = busy or eof_sent
            if busy:
                await asyncio.sleep(0)  # let the other channels have a turn
            else:
                await self._wait()

    async def _finish(self, chan: Any, pending: _Pending, terminate: bool) -> None:
        """After an exec failed or was cancelled: complete libssh2's half-sent calls, then (best
        effort) the TERM request and our CLOSE. sshd answers the CLOSE only once the command
        has exited, so this does not wait for that."""
        try:
            async with asyncio.timeout(FINISH_TIMEOUT):
                # A channel open in flight is not ours to close: the next open returns it.
                await self._flush_pending(pending)
                if chan is None:
                    return
                if terminate:
                    with contextlib.suppress(*_CHANNEL_ERRORS):
                        await self._flush(chan.signal, "TERM")
                with contextlib.suppress(*_CHANNEL_ERRORS):
                    await self._flush(chan.close)
        except TimeoutError:
            self._shutdown("a cancelled command's channel could not be closed")
        except (ConnectionLost, *_CHANNEL_ERRORS):
            pass

    async def _flush(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call until the request is sent, without waiting for an answer."""
        while _eagain(self._attempt(fn, *args)) and self._blocked_outbound():
            await self._wait()

    async def _flush_pending(self, pending: _Pending) -> None:
        """Repeat the calls that may have left a packet half sent until it is out: until then
        no other packet can be sent on the session."""
        for fn, args in list(pending.calls.values()):
            await self._flush(fn, *args)
        pending.calls.clear()

    async def sftp(self) -> Ssh2SFTP:
        if _EXTRAS is None:
            raise RemoteUnsupported(
                "this ssh2-python build lacks libssh2's readlink and posix-rename: "
                "use the asyncssh or paramiko backend for files"
            )
        pending = _Pending()
        try:
            # sftp_init opens the channel and starts the subsystem.
            sftp = await self._open_channel(self._session.sftp_init, pending)
        except ChannelRefused:
            raise  # sshd answered the open: nothing of it is left half sent
        except ConnectionLost as exc:
            raise ConnectionLost(str(exc), started=False) from exc
        except BaseException:
            self._spawn(self._finish(None, pending, terminate=False))
            raise
        if sftp is None:  # libssh2 gave no handle and no error: the subsystem was refused
            raise RemoteFileFailure("the host has no sftp subsystem")
        pointer = lib_pointer(sftp, self._session)
        if pointer is None:
            raise RemoteUnsupported("this ssh2-python build's SFTP object is not the one known")
        return Ssh2SFTP(self, sftp, pointer)

    # ---- closing

    def _shutdown(self, reason: str) -> None:
        """Mark the connection down, wake everyone (they raise ConnectionLost) and close our
        socket. libssh2's duplicate descriptor lives until the session is freed."""
        if self._failure is not None:
            return
        self._failure = reason
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._wake()
        with contextlib.suppress(Exception):
            self._session.disconnect()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    async def close(self) -> None:
        self._shutdown("connection closed")
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --------------------------------------------------------------------------------------------
# SFTP: libssh2's SFTP on a channel of the session, driven non-blocking like exec


LIBSSH2_ERROR_SFTP_PROTOCOL = -31
SFTP_FAILURE = 4  # SSH_FX_FAILURE


def _attrs(a: Any) -> FileAttrs:
    return FileAttrs.from_mode(a.permissions, a.filesize, a.mtime)


class Ssh2File:
    def __init__(self, fs: Ssh2SFTP, handle: Any, pointer: int, path: str) -> None:
        self._fs = fs
        self._h = handle
        self._ptr = pointer
        self._path = path
        self._closed = False

    async def read(self, size: int) -> bytes:
        # libssh2_sftp_read keeps several read requests in flight (read-ahead) and returns what
        # has arrived: gather up to `size` so the caller gets big pieces.
        parts: list[bytes] = []
        got = 0
        while got < size:
            n, data = await self._fs.op(self._path, self._h.read, size - got)
            if n == 0:
                break
            parts.append(data)
            got += n
        return b"".join(parts)

    async def write(self, data: bytes) -> None:
        # libssh2_sftp_write splits the buffer into pipelined write requests and says how much
        # was acknowledged; after EAGAIN the rest must be offered again from that offset.
        sent = 0
        try:
            while sent < len(data):
                chunk = data if sent == 0 else data[sent:]
                _, n = await self._fs.op(self._path, self._h.write, chunk, partial=True)
                sent += n
        except RemoteFileError as exc:
            raise translate.write_failed(exc, await self._fs.free_bytes(self._path)) from exc

    async def flush(self) -> None:
        # Every write returned answered: libssh2 packs a write's whole buffer at once and
        # expects the bytes still unanswered at the start of the next call's buffer, so a
        # write behind the next would cost a copy of both into one buffer (docs/files.md).
        return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._fs.close_handle(self._path, self._h, self._ptr)
        self._fs.files.discard(self)


class Ssh2SFTP:
    """One LIBSSH2_SFTP (its own channel) on an Ssh2Connection, used only from the event loop.

    libssh2 keeps each SFTP operation's progress in the session (one state per kind of
    operation): a call abandoned after EAGAIN would be resumed by the next call of that kind,
    with the old request's answer. So an operation interrupted half-way (cancelled, or the
    transport lost) makes the session unusable: every later call raises ConnectionLost, and
    closing it only lets libssh2 finish what it half sent."""

    def __init__(self, conn: Ssh2Connection, sftp: Any, pointer: int) -> None:
        self._conn = conn
        self._sftp = sftp
        self._ptr = pointer
        self._pending = _Pending()
        self._broken: str | None = None
        self._closed = False
        # Open files, to close before the session; a WeakSet: no reference cycle with them.
        self.files: weakref.WeakSet[Ssh2File] = weakref.WeakSet()
        # Every handle opened and not yet closed by us: given up on when the session breaks.
        self._handles: dict[int, Any] = {}

    async def op(
        self, path: str | None, fn: Callable[..., Any], *args: Any, partial: bool = False
    ) -> Any:
        """One libssh2 SFTP call, repeated until done; its failure in our tree. With `partial`,
        fn returns (code, progress) and is repeated only while code is EAGAIN and progress 0."""
        if self._broken is not None:
            raise ConnectionLost(self._broken, started=True)
        done = False
        try:
            while True:
                result = self._conn._attempt(fn, *args, pending=self._pending)
                if not _eagain(result) or (partial and result[1] > 0):
                    break
                await self._conn._wait()
            done = True
        except ssh2_errors.SFTPProtocolError as exc:
            done = True
            raise translate.sftp_error(self._sftp.last_error(), describe(exc), path) from exc
        except _SFTP_ERRORS as exc:
            done = True
            code = self._sftp.last_error() or SFTP_FAILURE
            raise translate.sftp_error(code, describe(exc), path) from exc
        except ConnectionLost as exc:
            raise ConnectionLost(f"connection lost during SFTP: {exc}", started=True) from exc
        except ssh2_errors.SSH2Error as exc:
            raise ConnectionLost(f"SFTP failed: {describe(exc)}", started=True) from exc
        finally:
            if not done:
                self._broken = "an SFTP operation was interrupted: the session is unusable"
                self._conn._spawn(self._conn._finish(None, self._pending, terminate=False))
        # The raw libssh2 calls (ctypes), and some of ssh2-python's, return an error code
        # instead of raising: first in a tuple or alone.
        code = result[0] if isinstance(result, tuple) else result
        if isinstance(code, int) and code < 0 and not (partial and code == EAGAIN):
            if code == LIBSSH2_ERROR_SFTP_PROTOCOL:
                status = self._sftp.last_error() or SFTP_FAILURE
                raise translate.sftp_error(status, f"SFTP status {status}", path)
            # A socket error or timeout: the transport is gone for every channel.
            self._conn._shutdown(f"connection lost: libssh2 error {code}")
            raise ConnectionLost(f"connection lost during SFTP: libssh2 error {code}", started=True)
        return result

    async def close_handle(self, path: str | None, handle: Any, pointer: int) -> None:
        """Close a file or directory handle to completion (repeated while EAGAIN), then make
        ssh2-python's object forget it. libssh2 frees the handle once the host answered, even
        with an error status."""
        assert _EXTRAS is not None
        try:
            await self.op(path, _EXTRAS.close_handle, pointer)
        except RemoteFileError:
            pass  # answered: freed all the same
        finally:
            if self._broken is None:
                forget_pointer(handle)
                self._handles.pop(pointer, None)

    def _handle(self, handle: Any) -> int:
        pointer = lib_pointer(handle, self._sftp)
        if pointer is None:
            raise RemoteUnsupported("this ssh2-python build's SFTP handle is not the one known")
        self._handles[pointer] = handle
        return pointer

    async def free_bytes(self, path: str) -> int | None:
        """Free space where `path` is (statvfs), None when unknown: tells ENOSPC apart."""
        with contextlib.suppress(RemoteFileError):
            vfs = await self.op(path, self._sftp.statvfs, path)
            return int(vfs.f_bavail * vfs.f_frsize)
        return None

    async def realpath(self, path: str) -> str:
        result: str = await self.op(path, self._sftp.realpath, path, 4096)
        return result

    async def realpaths(self, paths: Sequence[str]) -> list[str | None]:
        return await realpaths_in_turn(self, paths)

    async def stat(self, path: str) -> FileAttrs:
        return _attrs(await self.op(path, self._sftp.stat, path))

    async def lstat(self, path: str) -> FileAttrs:
        return _attrs(await self.op(path, self._sftp.lstat, path))

    async def readlink(self, path: str) -> str:
        assert _EXTRAS is not None  # sftp() refuses without them
        raw = path.encode()
        buf = ctypes.create_string_buffer(4096)
        n = await self.op(path, _EXTRAS.readlink, self._ptr, raw, len(raw), buf, len(buf), READLINK)
        return buf.raw[:n].decode(errors="replace")

    async def listdir(self, path: str) -> list[DirEntry]:
        async with contextlib.aclosing(self.scandir(path)) as entries:
            return [entry async for entry in entries]

    async def scandir(self, path: str) -> AsyncGenerator[DirEntry, None]:
        handle = await self.op(path, self._sftp.opendir, path)
        pointer = self._handle(handle)
        try:
            # One readdir call per entry: libssh2 asks the host for the next reply only when
            # the one it holds is used up (one READDIR in flight).
            items = handle.readdir(1024)
            while True:
                item = await self.op(path, next, items, None)
                if item is None:
                    break
                _, name, attrs = item
                text = name.decode(errors="replace")
                if text not in (".", ".."):
                    yield DirEntry(text, _attrs(attrs))
        finally:
            if self._broken is None:
                await self.close_handle(path, handle, pointer)

    async def _open(self, path: str, flags: int, mode: int) -> Ssh2File:
        handle = await self.op(path, self._sftp.open, path, flags, mode)
        f = Ssh2File(self, handle, self._handle(handle), path)
        self.files.add(f)
        return f

    async def open_read(self, path: str, offset: int = 0) -> Ssh2File:
        f = await self._open(path, LIBSSH2_FXF_READ, 0)
        f._h.seek64(offset)  # local: the next read request starts there
        return f

    async def open_write(self, path: str, *, exclusive: bool = True, mode: int = 0o644) -> Ssh2File:
        flags = LIBSSH2_FXF_WRITE | LIBSSH2_FXF_CREAT | LIBSSH2_FXF_TRUNC
        return await self._open(path, flags | (LIBSSH2_FXF_EXCL if exclusive else 0), mode)

    async def open_resume(self, path: str, offset: int) -> Ssh2File:
        f = await self._open(path, LIBSSH2_FXF_WRITE, 0)  # no CREAT, no TRUNC
        f._h.seek64(offset)  # local: the next write request starts there
        return f

    async def rename(self, old: str, new: str, *, overwrite: bool) -> None:
        if overwrite:
            assert _EXTRAS is not None
            a, b = old.encode(), new.encode()
            await self.op(old, _EXTRAS.posix_rename, self._ptr, a, len(a), b, len(b))
        else:
            await self.op(old, self._sftp.rename, old, new)

    async def remove(self, path: str) -> None:
        await self.op(path, self._sftp.unlink, path)

    async def rmdir(self, path: str) -> None:
        await self.op(path, self._sftp.rmdir, path)

    async def mkdir(self, path: str, mode: int = 0o755) -> None:
        await self.op(path, self._sftp.mkdir, path, mode)

    async def setstat(
        self, path: str, *, mode: int | None = None, mtime: int | None = None
    ) -> None:
        attrs = SFTPAttributes()
        flags = 0
        if mode is not None:
            flags |= LIBSSH2_SFTP_ATTR_PERMISSIONS
            attrs.permissions = mode
        if mtime is not None:
            flags |= LIBSSH2_SFTP_ATTR_ACMODTIME
            attrs.atime = attrs.mtime = mtime
        attrs.flags = flags
        await self.op(path, self._sftp.setstat, path, attrs)

    def receive_window(self) -> int:
        """Its channel's receive window now: libssh2 opens it with 2 MiB and, before each
        read-ahead, grows it by eight times the read-ahead when it is smaller (sftp.c,
        sftp_read)."""
        assert _EXTRAS is not None  # sftp() refuses without them
        window: int = _EXTRAS.window_read(_EXTRAS.get_channel(self._ptr), None, None)
        return window

    def intact(self) -> bool:
        # An interrupted operation breaks the session for good, and a broken session cannot
        # close its channel (see close()): only retiring the connection frees that channel.
        return self._broken is None

    async def close(self) -> None:
        """Close the files left open, then shut the SFTP session down (its channel closed),
        each call repeated until done. A broken session sends nothing more: its libssh2
        handles and SFTP structure are forgotten, not freed (a few hundred bytes each; the
        pool discards the connection, whose libssh2 session frees the channel)."""
        if self._closed:
            return
        self._closed = True
        assert _EXTRAS is not None
        try:
            for f in list(self.files):
                with contextlib.suppress(RemoteFileError):
                    await f.close()
            if self._broken is None:
                await self.op(None, _EXTRAS.shutdown, self._ptr)
        except SSHPoolError:
            self._broken = self._broken or "closing the SFTP session failed"
        except asyncio.CancelledError:
            self._broken = self._broken or "closing the SFTP session was cancelled"
            raise
        finally:
            if self._broken is not None:
                for handle in self._handles.values():
                    forget_pointer(handle)
                self._handles.clear()
            forget_pointer(self._sftp)


# --------------------------------------------------------------------------------------------
# Connecting


async def _open_socket(host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    error: OSError = ConnectionRefusedError(f"no address for {host}")
    for family, kind, proto, _, addr in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


async def _handshake(conn: Ssh2Connection, session: Any, target: Target, lines: list[str]) -> None:
    lib_fd = _LibFd(os.dup(conn._fd))
    try:
        await conn._call(session.handshake, lib_fd)
    except ConnectionLost as exc:
        # sshd drops connections past MaxStartups with a reset or EOF before its banner.
        raise translate.dropped(target) from exc
    key, _ = session.hostkey()
    known = session.knownhost_init()
    for line in lines:
        # A line libssh2 cannot parse (a key type it lacks) cannot vouch for the key: skip it.
        with contextlib.suppress(ssh2_errors.KnownHostError):
            known.readline(line.encode())
    try:
        known.checkp(
            target.host.encode(),
            target.port,
            key,
            LIBSSH2_KNOWNHOST_TYPE_PLAIN | LIBSSH2_KNOWNHOST_KEYENC_RAW,
        )
    except ssh2_errors.KnownHostError as exc:
        raise HostKeyMismatch(
            f"{target}: host key not verified against {target.known_hosts}: {describe(exc)}"
        ) from exc


def _logins(target: Target, session: Any) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, one authentication call) per key to offer, in order. A certificate login passes
    its fresh key and certificate from memory (libssh2 >= 1.11 takes the certificate as the
    public key)."""
    creds = target.credentials()
    if creds is not None:
        login = functools.partial(
            session.userauth_publickey_frommemory,
            target.username,
            creds.private_key,
            "",
            creds.certificate,
        )
        yield f"certificate {creds.key_id}", login
        return
    for path in target.client_keys:
        yield path, functools.partial(session.userauth_publickey_fromfile, target.username, path)


async def _authenticate(conn: Ssh2Connection, session: Any, target: Target) -> None:
    refused: list[str] = []
    for path, login in _logins(target, session):
        try:
            await conn._call(login)
        except ConnectionLost as exc:
            raise ConnectError(f"{target}: connection lost during authentication") from exc
        except _KEY_ERRORS as exc:
            refused.append(f"{path}: {describe(exc)}")
            continue
        return
    raise AuthenticationFailed(f"{target}: no client key accepted ({'; '.join(refused)})")


def _connect_table(exc: BaseException, target: Target) -> SSHPoolError | None:
    """libssh2's own failures are translated where they happen (handshake, known_hosts, keys):
    an SSH2Error left over is a plain ConnectError, the shared rules' default."""
    return None


class Ssh2Backend:
    name = "ssh2"

    async def connect(self, target: Target) -> Ssh2Connection:
        try:
            lines = _known_host_lines(target)
        except OSError as exc:
            raise translate.unreadable_known_hosts(target, exc) from exc
        if not lines:
            raise translate.unknown_host(target)
        conn: Ssh2Connection | None = None
        try:
            async with asyncio.timeout(target.limits.connect_timeout):
                session = Session()
                session.set_blocking(False)
                offered = session.supported_algs(LIBSSH2_METHOD_HOSTKEY)
                # libssh2 prefers ECDSA: offer first what known_hosts can check.
                known_types = [line.split()[1] for line in lines]
                preference = translate.hostkey_preference(offered, known_types)
                session.method_pref(LIBSSH2_METHOD_HOSTKEY, ",".join(preference))
                stages = tracing.stages()  # the connect's trace (sshpool.tracing)
                began = time.time_ns()
                conn = Ssh2Connection(
                    await _open_socket(target.host, target.port), session, target.limits
                )
                if stages is not None:
                    stages.mark("connect", began)
                await _handshake(conn, session, target, lines)
                if stages is not None:
                    stages.mark("key_exchange")
                await _authenticate(conn, session, target)
                if stages is not None:
                    stages.mark("authentication")
        except BaseException as exc:
            if conn is not None:
                await conn.close()
            if isinstance(exc, (OSError, ssh2_errors.SSH2Error)):
                raise translate.connect_error(exc, target, _connect_table) from exc
            raise
        conn.start()
        return conn
