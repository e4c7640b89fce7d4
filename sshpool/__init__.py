"""sshpool: SSH connections kept open and shared, commands multiplexed as channels.

Usable on its own: `from sshpool import Pool, Target` (`UserCA` for certificate logins). Every
type the pool hands to its callers is exported here, so callers import nothing of the
submodules: the errors, the command result, the certificate credentials, and the SFTP session
`Pool.sftp` yields with the files and attributes it returns (its interface lives with the
backends', in `sshpool.backends.base`).

The modules, from the face down (no two import each other, directly or round about:
tests/test_layout.py):

    pool         `Pool`, the face: targets to host pools, sshd resolution, maintenance,
                 clusters; the host pool's invariants in its docstring
    cluster      login-node clusters (`Router`), seeing the pool through `NodePools` only
    host         `HostPool`, one target's state machine: leases, kills, SFTP, the gate
    lane         the transfer lane: bulk SFTP on connections whose I/O runs on a thread of
                 its own (`Lane`), and its fair turns of chunks
    connect      the connect path as plain I/O: handshake retried after drops, executor start
                 (and a host's agent mode, `AgentMode`)
    lease        a pooled connection, a slot's exec, the one kill and the one retry policy
    budget       one sshd's handshake gate and connection budget, shared by its accounts
    waiters      the tenants' turns
    durations    bucket counts of the connect and slot-wait times (read by the API's metrics)
    breaker      the circuit breaker and the sshd's login penalties
    command      the command line, its wrapper and captures, the result
    target       `Target` and `Limits`
    certificates short-lived user certificates minted per connection
    errors       the error tree
    tracing      the stages as OpenTelemetry spans (the OpenTelemetry API only: a no-op
                 without an SDK), under a caller's recording span only
    agent/       agent mode (the executor and its client)
    backends/    the SSH libraries behind one interface
    devhost/     the development rig: never loaded by `import sshpool`
"""

from sshpool.backends.base import DirEntry, FileAttrs, FileType, RemoteFile, SFTPSession
from sshpool.budget import Coordinator, Sshd, StaticShare, static_share
from sshpool.certificates import Credentials, UserCA
from sshpool.cluster import NodeHealth, Router
from sshpool.command import CommandResult, OutputStream
from sshpool.durations import Durations
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
from sshpool.lane import Lane
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
    "Durations",
    "ExecMode",
    "FileAttrs",
    "FileType",
    "HostKeyMismatch",
    "HostUnavailable",
    "Lane",
    "Limits",
    "NodeFailed",
    "NodeHealth",
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
    "Router",
    "SFTPSession",
    "SSHPoolError",
    "Sshd",
    "StaticShare",
    "Target",
    "UserCA",
    "static_share",
]
