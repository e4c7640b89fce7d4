"""What to connect to (`Target`, the pool key) and how hard to use it (`Limits`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# How commands reach the host: a session channel each ("channel"), or one resident executor
# per connection that runs them all ("agent", sshpool.agent; docs/pool.md).
ExecMode = Literal["channel", "agent"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-host pool limits. Defaults stay inside a stock sshd (MaxStartups 10:30:100,
    MaxSessions 10) with room for the kill channel and the lag of freed session slots."""

    max_connections: int = 4
    min_connections: int = 0
    # Stock MaxSessions is 10; 8 leaves room for a kill channel and for slots sshd frees late.
    max_sessions: int = 8
    # Handshakes in flight to one sshd, all its accounts together (per account with
    # per_sshd=False). Stock MaxStartups starts dropping at 10 unauthenticated connections, and
    # sshd counts a handshake as done only once its listener reads that: 6 leaves room for that
    # lag and for other clients' logins (docs/pool.md, "One sshd, many accounts").
    max_handshakes: int = 6
    max_waiters: int = 1000
    # Connections to one sshd over all its accounts (the pool's per-sshd budget: docs/pool.md
    # says why 64); idle ones of other accounts are closed least recently used first for room.
    max_total_connections: int = 64
    connect_timeout: float = 10.0
    keepalive_interval: float = 15.0
    keepalive_count_max: int = 3
    idle_timeout: float = 300.0
    max_lifetime: float = 3600.0
    # Consecutive connect failures that open the breaker, and its jittered, doubling back-off.
    breaker_threshold: int = 3
    breaker_backoff: float = 1.0
    breaker_backoff_max: float = 30.0
    # False reproduces the connection-per-request design (one command per connection, then
    # close) for comparisons; pair it with max_sessions=1 and a wide handshake gate.
    reuse: bool = True
    # False: the handshake gate and the connection count per account instead of per sshd, and a
    # dropped handshake retried once (the pool before issue 29), for comparisons.
    per_sshd: bool = True
    # Agent mode (Target.exec_mode "agent"): commands one executor runs at once per connection
    # (it takes two more, for kills), and how long its start (the login shell, python3) may take.
    agent_max_commands: int = 32
    agent_start_timeout: float = 30.0

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_sessions, self.max_handshakes) < 1:
            raise ValueError("max_connections, max_sessions and max_handshakes must be >= 1")
        if self.max_total_connections < 1:
            raise ValueError("max_total_connections must be >= 1")
        if self.agent_max_commands < 1:
            raise ValueError("agent_max_commands must be >= 1")
        if not 0 <= self.min_connections <= self.max_connections:
            raise ValueError("min_connections must be between 0 and max_connections")


@dataclass(frozen=True, slots=True)
class Target:
    """One account on one SSH host. Equal targets share pooled connections."""

    host: str
    username: str
    client_keys: tuple[str, ...]
    known_hosts: str
    port: int = 22
    limits: Limits = field(default_factory=Limits)
    # The SSH library for this host ("asyncssh", "paramiko", "ssh2"); None: the pool's own.
    backend: str | None = None
    exec_mode: ExecMode = "channel"
    # The interpreter agent mode starts on the host (looked up in the login shell's PATH).
    agent_python: str = "python3"

    def __post_init__(self) -> None:
        if not self.client_keys:
            raise ValueError("a target needs at least one client key")
        if not self.known_hosts:
            # Fail closed: there is no "accept any host key" mode.
            raise ValueError("a target needs a known_hosts file")

    def __str__(self) -> str:
        where = f"{self.username}@{self.host}:{self.port}"
        how = ", ".join(
            x for x in (self.backend, "agent" if self.exec_mode == "agent" else "") if x
        )
        return f"{where} ({how})" if how else where
