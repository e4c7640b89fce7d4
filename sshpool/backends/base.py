"""The backend interface: the little the pool needs from an SSH library.

A backend connects a Target; a connection runs one command per channel, many at once. Backends
raise only sshpool.errors exceptions: each translates its library's errors in one place (its own
table, plus the shared rules of `sshpool.backends.translate`).

Only the interface lives here; `sshpool.backends.load_backend` finds a backend by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sshpool.command import Capture
from sshpool.target import Target


@dataclass(frozen=True, slots=True)
class Exit:
    """How the remote command ended: an exit status, or the signal that killed it."""

    status: int | None
    signal: str | None = None


class Connection(Protocol):
    def is_alive(self) -> bool:
        """True while the transport is up, judged without I/O."""
        ...

    async def exec(
        self, command: str, stdin: bytes | None, stdout: Capture, stderr: Capture
    ) -> Exit:
        """Open a session channel, run `command`, write `stdin` then EOF, drain both streams
        concurrently into the captures, and return how it ended.

        Output is fed to the captures on the event loop's thread, chunk by chunk as the channel
        delivers it (never held back until the end): `Capture.on_data` observers (live output)
        rely on that. Feeding never waits on the capture; the hook must not block either.

        Raises ChannelRefused when sshd refuses the channel, and ConnectionLost (with `started`
        true once the exec request may have reached sshd) when the transport drops. On
        cancellation it sends the TERM signal request (best effort), closes the channel and
        re-raises; killing the process group is the pool's job.
        """
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
