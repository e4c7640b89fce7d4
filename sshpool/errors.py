"""The one exception tree of sshpool. Backends translate their library's errors into it.

```
SSHPoolError
├── PoolTimeout        no channel slot became free before the caller's deadline
├── PoolFull           the wait queue is at max_waiters: refused at once
├── HostUnavailable    the host's circuit breaker is open after repeated connect failures
├── ConnectTimeout     TCP connect, key exchange or auth did not finish in time
├── CommandTimeout     the command ran past its timeout; its remote process group was killed
├── ConnectError       the connection could not be made (refused, reset, unreachable)
│   ├── AuthenticationFailed   the host rejected every client key
│   └── HostKeyMismatch        the host key is not the one in known_hosts (nothing was sent)
├── ChannelRefused     sshd refused a channel (MaxSessions); the pool retries, callers never see it
├── ConnectionLost     the connection dropped; `started` says whether the command may have run
│   └── NodeFailed     a cluster's login node failed while the command ran there (started)
├── AgentUnavailable   agent mode: the host has no usable python3 (the pool falls back to channels)
├── NotAdmitted        the application's gate (`Pool.admit`) refused the caller: nothing started
└── RemoteFileError    an SFTP operation failed on the host; the connection is fine
    ├── RemoteNotFound          no such file or directory
    ├── RemotePermissionDenied  the account may not do that there
    ├── RemoteNoSpace           the host's filesystem (or the account's quota) is full
    ├── RemoteUnsupported       the backend cannot do that operation (its library lacks it)
    └── RemoteFileFailure       any other refusal: exists, not a directory, not empty, ...
```

The API maps PoolTimeout, PoolFull and HostUnavailable to 503 + Retry-After, ConnectTimeout to 504,
ConnectError to 502, CommandTimeout to the job state `timed_out`, ConnectionLost after start to
the job state `lost`, and NotAdmitted to 403 (the caller was revoked). The API maps the
RemoteFileError family to 404, 403, 507, 501 and 409.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sshpool.command import CommandResult


class SSHPoolError(Exception):
    """Base class of every error sshpool raises."""

    # A failed connect's stamps (a `sshpool.tracing.Stages`, set by sshpool.connect): the
    # commands it fails trace its handshake. Typed loosely: tracing imports this module.
    stages: Any = None


class PoolTimeout(SSHPoolError):
    """No channel slot became free before the caller's deadline."""

    retry_after: float = 1.0


class PoolFull(SSHPoolError):
    """The wait queue for this host already holds max_waiters callers."""

    retry_after: float = 1.0


class HostUnavailable(SSHPoolError):
    """The host's circuit breaker is open; no connect is attempted until `retry_after` passes."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ConnectTimeout(SSHPoolError):
    """TCP connect, key exchange or authentication took longer than connect_timeout."""


class CommandTimeout(SSHPoolError):
    """The command outlived its timeout; its process group was killed. `result` has the partial
    output."""

    def __init__(self, message: str, result: CommandResult) -> None:
        super().__init__(message)
        self.result = result


class ConnectError(SSHPoolError):
    """The connection could not be made: refused, reset before the banner, unreachable.

    `retryable` is true for a reset or EOF before the SSH banner (sshd's MaxStartups drop): the
    pool retries those once after a short pause; a refused port is not retried."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class AuthenticationFailed(ConnectError):
    """The host accepted none of the client keys. Not retried: retrying cannot help."""


class HostKeyMismatch(ConnectError):
    """The host's key is not the one known_hosts lists for it. Nothing was sent to the host."""


class ChannelRefused(SSHPoolError):
    """sshd refused to open a session channel (MaxSessions). Handled inside the pool."""


class ConnectionLost(SSHPoolError):
    """The connection dropped. If `started`, the command may have run and its outcome is unknown;
    if not, the pool has already retried once on a fresh connection. `remote_pgid` is the remote
    command's process group when it had started: it may still run there (an orphan to find),
    unless `remote_killed` (agent mode: the executor died, its connection lived, and the group
    was killed over it)."""

    def __init__(self, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.started = started
        self.remote_pgid: int | None = None
        self.remote_killed = False


class NotAdmitted(SSHPoolError):
    """The application's gate (`Pool.admit`) refused this caller on this target, before the
    connect, the channel, the executor's START or the SFTP session: nothing ran."""


class NodeFailed(ConnectionLost):
    """A login node of a cluster (`Target.nodes`) failed while the command ran on it: its
    connection dropped and the node did not answer a probe. The outcome is unknown and the
    command was not run elsewhere; `node` names the node."""

    def __init__(self, message: str, node: str) -> None:
        super().__init__(message, started=True)
        self.node = node


class AgentUnavailable(SSHPoolError):
    """Agent mode could not start its executor on the host (no python3, too old a one, a
    forced command that refuses it). The pool runs that host's commands as channels instead."""


class RemoteFileError(SSHPoolError):
    """An SFTP operation failed on the host (the host answered with an error status); the
    connection and the SFTP session stay usable. `path` is the remote path it was about."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class RemoteNotFound(RemoteFileError):
    """The file or directory (or one of its parents) does not exist on the host."""


class RemotePermissionDenied(RemoteFileError):
    """The host refused the operation to the account (file mode, ownership, read-only mount)."""


class RemoteNoSpace(RemoteFileError):
    """A write failed because the filesystem (or the account's quota) has no room left."""


class RemoteFileFailure(RemoteFileError):
    """Any other SFTP failure: the target exists, is not a directory, is not empty, ..."""


class RemoteUnsupported(RemoteFileError):
    """The backend cannot do this file operation: its SSH library lacks it (the host is fine)."""
