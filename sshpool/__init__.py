"""sshpool: SSH connections kept open and shared, commands multiplexed as channels.

Usable on its own: `from sshpool import Pool, Target`.
"""

from sshpool.command import CommandResult, OutputStream
from sshpool.errors import (
    AuthenticationFailed,
    ChannelRefused,
    CommandTimeout,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HostKeyMismatch,
    HostUnavailable,
    PoolFull,
    PoolTimeout,
    RemoteFileError,
    RemoteFileFailure,
    RemoteNoSpace,
    RemoteNotFound,
    RemotePermissionDenied,
    RemoteUnsupported,
    SSHPoolError,
)
from sshpool.pool import Pool
from sshpool.target import Limits, Target

__all__ = [
    "AuthenticationFailed",
    "ChannelRefused",
    "CommandResult",
    "CommandTimeout",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLost",
    "HostKeyMismatch",
    "HostUnavailable",
    "Limits",
    "OutputStream",
    "Pool",
    "PoolFull",
    "PoolTimeout",
    "RemoteFileError",
    "RemoteFileFailure",
    "RemoteNoSpace",
    "RemoteNotFound",
    "RemotePermissionDenied",
    "RemoteUnsupported",
    "SSHPoolError",
    "Target",
]
