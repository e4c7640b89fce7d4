"""sshpool: SSH connections kept open and shared, commands multiplexed as channels.

Usable on its own: `from sshpool import Pool, Target` (`UserCA` for certificate logins). Every
type the pool hands to its callers is exported here, so callers import nothing of the
submodules: the errors, the command result, the certificate credentials, and the SFTP session
`Pool.sftp` yields with the files and attributes it returns (its interface lives with the
backends', in `sshpool.backends.base`).
"""

from sshpool.backends.base import DirEntry, FileAttrs, FileType, RemoteFile, SFTPSession
from sshpool.budget import Coordinator, Sshd, StaticShare, static_share
from sshpool.certificates import Credentials, UserCA
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
    NodeFailed,
    NotAdmitted,
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
from sshpool.target import ExecMode, Limits, Target

__all__ = [
    "AuthenticationFailed",
    "ChannelRefused",
    "CommandResult",
    "CommandTimeout",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLost",
    "Coordinator",
    "Credentials",
    "DirEntry",
    "ExecMode",
    "FileAttrs",
    "FileType",
    "HostKeyMismatch",
    "HostUnavailable",
    "Limits",
    "NodeFailed",
    "NotAdmitted",
    "OutputStream",
    "Pool",
    "PoolFull",
    "PoolTimeout",
    "RemoteFile",
    "RemoteFileError",
    "RemoteFileFailure",
    "RemoteNoSpace",
    "RemoteNotFound",
    "RemotePermissionDenied",
    "RemoteUnsupported",
    "SFTPSession",
    "SSHPoolError",
    "Sshd",
    "StaticShare",
    "Target",
    "UserCA",
    "static_share",
]
