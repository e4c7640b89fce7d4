"""The asyncssh backend: native asyncio, one SSH connection multiplexes many session channels.

asyncssh does nearly everything itself (known_hosts, host key preference, keepalives and dead
peer detection, exit signals). What it does not do and this module adds:
- A liveness flag that needs no I/O (`is_alive`), from the connection_lost callback.
- `started` on a lost connection: whether the exec request may have reached sshd.
- The SSH signal request (TERM) on cancel, best effort.

Every asyncssh error is translated into sshpool.errors here (its table) and in
`sshpool.backends.translate` (the shared rules), nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncssh

from sshpool.backends import translate
from sshpool.backends.base import Exit
from sshpool.command import Capture
from sshpool.errors import (
    AuthenticationFailed,
    ChannelRefused,
    ConnectError,
    ConnectionLost,
    HostKeyMismatch,
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
    """Tracks whether the transport is up, so is_alive() needs no I/O."""

    def __init__(self) -> None:
        self.alive = True

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


class AsyncsshConnection:
    def __init__(self, conn: asyncssh.SSHClientConnection, client: _Client) -> None:
        self._conn = conn
        self._client = client

    def is_alive(self) -> bool:
        return self._client.alive

    async def exec(
        self, command: str, stdin: bytes | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        session = _Session(stdout, stderr)
        try:
            chan, _ = await self._conn.create_session(lambda: session, command, encoding=None)
        except asyncssh.ChannelOpenError as exc:
            if not self.is_alive():
                raise ConnectionLost(str(exc), started=session.chan is not None) from exc
            # MaxSessions: "open failed" (code 2) on OpenSSH 9, code 1 on older sshd.
            raise ChannelRefused(f"channel refused: {exc.reason}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise ConnectionLost(str(exc), started=session.chan is not None) from exc
        except asyncio.CancelledError:
            if session.chan is not None:
                session.chan.close()
            raise
        try:
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


class AsyncsshBackend:
    name = "asyncssh"

    async def connect(self, target: Target) -> AsyncsshConnection:
        limits = target.limits
        client = _Client()
        options: dict[str, Any] = {
            "username": target.username,
            "client_keys": list(target.client_keys),
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
        }
        try:
            conn = await asyncssh.connect(
                target.host, target.port, client_factory=lambda: client, **options
            )
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            raise translate.connect_error(exc, target, _connect_table) from exc
        return AsyncsshConnection(conn, client)
