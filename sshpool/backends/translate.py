"""The rules every backend shares: how a failed connect maps onto sshpool.errors, how a host is
named in known_hosts, which host key algorithms to offer first, when a silent peer is dead.

Each backend keeps only its own library's table (an exception type or message -> one of our
errors) and passes it to `connect_error`; everything here is library-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sshpool.errors import (
    ConnectError,
    ConnectTimeout,
    HostKeyMismatch,
    RemoteFileError,
    RemoteFileFailure,
    RemoteNoSpace,
    RemoteNotFound,
    RemotePermissionDenied,
    SSHPoolError,
)
from sshpool.target import Limits, Target

# A backend's own table: our error for a library exception, or None to apply the shared rules.
LibraryTable = Callable[[BaseException, Target], SSHPoolError | None]


def connect_error(
    exc: BaseException, target: Target, library: LibraryTable, *, timed_out: bool = False
) -> SSHPoolError:
    """The one mapping from a connect failure to the sshpool tree, in this order:

    1. our own errors pass through (raised inside a backend's connect);
    2. a timeout (or `timed_out`: the connect deadline has passed) -> ConnectTimeout;
    3. the backend's `library` table;
    4. refused -> ConnectError; a reset, broken pipe or EOF before the session -> ConnectError
       retryable (sshd drops connections past MaxStartups that way, before its banner);
    5. anything else -> ConnectError naming the exception.
    """
    if isinstance(exc, SSHPoolError):
        return exc
    if timed_out or isinstance(exc, TimeoutError):
        return timeout(target)
    mapped = library(exc, target)
    if mapped is not None:
        return mapped
    if isinstance(exc, ConnectionRefusedError):
        return ConnectError(f"{target}: connection refused")
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, EOFError)):
        return dropped(target, exc)
    return ConnectError(f"{target}: {describe(exc)}")


def timeout(target: Target) -> ConnectTimeout:
    """No authenticated session within the target's connect timeout."""
    return ConnectTimeout(f"{target}: no SSH session within {target.limits.connect_timeout} s")


def dropped(target: Target, exc: BaseException | None = None) -> ConnectError:
    """sshd closed the connection before the session was up: load shedding, worth one retry."""
    detail = f": {describe(exc)}" if exc is not None else ""
    return ConnectError(f"{target}: connection dropped during handshake{detail}", retryable=True)


def describe(exc: BaseException) -> str:
    """An exception as text; many SSH libraries' exceptions carry no message, so the class name
    says what failed."""
    detail = " ".join(str(a) for a in exc.args if a)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def known_host_name(target: Target) -> str:
    """How known_hosts names the target: ``host``, or ``[host]:port`` off port 22."""
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


def unknown_host(target: Target) -> HostKeyMismatch:
    """known_hosts has no key for the target: fail closed, before sending anything, since there
    is no key to compare with."""
    return HostKeyMismatch(f"{target}: {known_host_name(target)} is not in {target.known_hosts}")


def unreadable_known_hosts(target: Target, exc: OSError) -> ConnectError:
    """The target's known_hosts file cannot be read."""
    return ConnectError(f"{target}: cannot read {target.known_hosts}: {exc}")


def hostkey_preference(offered: Sequence[str], known_types: Iterable[str]) -> list[str]:
    """The library's host key algorithms (`offered`), those known_hosts has a key for first, as
    OpenSSH does: a host with several host keys must present one we can check. An ssh-rsa key
    is checked by the rsa-sha2-* algorithms too."""
    wanted = set(known_types)
    if "ssh-rsa" in wanted:
        wanted |= {"rsa-sha2-512", "rsa-sha2-256"}
    return [a for a in offered if a in wanted] + [a for a in offered if a not in wanted]


def peer_dead(limits: Limits, silent: float) -> bool:
    """asyncssh's rule for every backend: with keepalives on, a peer silent for
    keepalive_count_max + 1 intervals (count_max unanswered keepalives) is dead."""
    interval = limits.keepalive_interval
    return interval > 0 and silent > interval * (limits.keepalive_count_max + 1)


# SFTP status codes (draft-ietf-secsh-filexfer): v3 (OpenSSH) sends 2-4 and 8; the others come
# from servers speaking later versions.
_SFTP_STATUS: dict[int, type[RemoteFileError]] = {
    2: RemoteNotFound,  # SSH_FX_NO_SUCH_FILE
    10: RemoteNotFound,  # SSH_FX_NO_SUCH_PATH
    3: RemotePermissionDenied,  # SSH_FX_PERMISSION_DENIED
    12: RemotePermissionDenied,  # SSH_FX_WRITE_PROTECT
    14: RemoteNoSpace,  # SSH_FX_NO_SPACE_ON_FILESYSTEM
    15: RemoteNoSpace,  # SSH_FX_QUOTA_EXCEEDED
}


def sftp_error(code: int, message: str, path: str | None) -> RemoteFileError:
    """The one mapping from an SFTP status to the sshpool tree. OpenSSH reports a full disk as a
    plain failure (4): backends check free space after a failed write (`write_failed`)."""
    text = f"{path}: {message}" if path else message
    return _SFTP_STATUS.get(code, RemoteFileFailure)(text, path)


def write_failed(error: RemoteFileError, free_bytes: int | None) -> RemoteFileError:
    """A write (or its close) failed: when the filesystem has no room left (statvfs f_bavail x
    f_frsize, None when unknown), the cause was ENOSPC, which SFTP v3 cannot say."""
    if type(error) is RemoteFileFailure and free_bytes is not None and free_bytes < 1 << 16:
        return RemoteNoSpace(f"{error.path}: no space left on the host", error.path)
    return error
