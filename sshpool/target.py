"""What to connect to (`Target`, the pool key) and how hard to use it (`Limits`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Literal

from sshpool import tracing
from sshpool.certificates import Credentials, UserCA

# How commands reach the host: a session channel each ("channel"), one resident executor per
# connection that runs them all ("agent", sshpool.agent; docs/pool.md), or the executor on each
# connection where the host's python3 answers and channels on the others ("auto": the API's
# default; a program using sshpool opts in, Target's default stays "channel").
ExecMode = Literal["channel", "agent", "auto"]


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
    # A refused login (an account sshd does not let in) opens the breaker at once for this
    # back-off, doubling to the cap: retrying soon fails again and costs sshd penalty time.
    auth_backoff: float = 10.0
    auth_backoff_max: float = 300.0
    # sshd's PerSourcePenalties as the pool assumes it (OpenSSH's defaults authfail:5, min:15):
    # logins that may be refused are spaced so that refusals never reach the threshold.
    penalty_per_failure: float = 5.0
    penalty_threshold: float = 15.0
    # False reproduces the connection-per-request design (one command per connection, then
    # close) for comparisons; pair it with max_sessions=1 and a wide handshake gate.
    reuse: bool = True
    # False: the handshake gate and the connection count per account instead of per sshd, and a
    # dropped handshake retried once (the pool before issue 29), for comparisons.
    per_sshd: bool = True
    # Bytes per second one transfer on the lane should be able to reach (sshpool.lane): with
    # the round trip measured on each lane connection it sizes the SSH window and the bytes
    # per SFTP call (the bandwidth-delay product); 125e6 is a gigabit link.
    transfer_bandwidth: float = 125e6
    # Agent mode (Target.exec_mode "agent"): commands one executor runs at once per connection
    # (it takes two more, for kills), and how long its start (the login shell, python3) may take.
    agent_max_commands: int = 32
    agent_start_timeout: float = 30.0
    # Login-node clusters (Target.nodes; sshpool.cluster): an account moves off its node for a
    # command while that node's queue for it holds this many waiters; a node in use is probed
    # this often (over the host's service account, `Pool.probe_with`, or at its SSH banner),
    # a node marked down every half second.
    spill_waiters: int = 16
    probe_interval: float = 5.0

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_sessions, self.max_handshakes) < 1:
            raise ValueError("max_connections, max_sessions and max_handshakes must be >= 1")
        if self.max_total_connections < 1:
            raise ValueError("max_total_connections must be >= 1")
        if self.agent_max_commands < 1:
            raise ValueError("agent_max_commands must be >= 1")
        if self.spill_waiters < 1 or self.probe_interval <= 0:
            raise ValueError("spill_waiters must be >= 1 and probe_interval > 0")
        if not 0 <= self.min_connections <= self.max_connections:
            raise ValueError("min_connections must be between 0 and max_connections")


@dataclass(frozen=True, slots=True)
class Target:
    """One account on one SSH host. Equal targets share pooled connections.

    It logs in with its `client_keys` (private key files), or, with `ca` set, with a fresh
    certificate of that CA per connection (`UserCA.mint(username, identity)`; `client_keys` is
    then empty). `identity` names on whose behalf (sshd logs it in the certificate's key id);
    it is part of the pool key, so two identities never share a connection, nor a breaker.

    With `nodes`, the host is a cluster of login nodes (`host` is then its name, for messages):
    each command goes to one node (`sshpool.cluster`), as the target `node_target(node)`. A
    node is ``name`` or ``name:port`` (``[v6]:port``); without a port, `port` applies.
    """

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
    ca: UserCA | None = None
    identity: str = ""
    nodes: tuple[str, ...] = ()
    # False: the nodes do not share file systems, so an account's SFTP sessions always go to
    # the same node (its first by rendezvous over all nodes, healthy or not).
    shared_files: bool = True

    def __post_init__(self) -> None:
        if self.ca is None and not self.client_keys:
            raise ValueError("a target needs at least one client key, or a CA")
        if self.ca is not None and self.client_keys:
            raise ValueError("a target logs in with client keys or a CA, not both")
        if self.ca is not None:
            self.ca.check_identity(self.identity or self.username)
        if not self.known_hosts:
            # Fail closed: there is no "accept any host key" mode.
            raise ValueError("a target needs a known_hosts file")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("a cluster's nodes must be distinct")
        for node in self.nodes:
            split_node(node, self.port)  # refuse a malformed node now

    def node_target(self, node: str) -> Target:
        """The target of one node of this cluster: the same account, keys and limits."""
        host, port = split_node(node, self.port)
        return replace(self, host=host, port=port, nodes=())

    def credentials(self) -> Credentials | None:
        """A fresh key pair and certificate for one connection (None: log in with
        client_keys). Called by the backends at each connect, never kept."""
        if self.ca is None:
            return None
        began = time.time_ns()
        creds = self.ca.mint(self.username, self.identity or self.username)
        stages = tracing.stages()
        if stages is not None:
            stages.mark("certificate", began)
        return creds

    def __str__(self) -> str:
        where = f"{self.username}@{self.host}:{self.port}"
        how = ", ".join(
            x for x in (self.backend, "agent" if self.exec_mode == "agent" else "") if x
        )
        return f"{where} ({how})" if how else where


def split_node(node: str, port: int) -> tuple[str, int]:
    """``name``, ``name:port`` or ``[v6]:port`` -> (name, port); ValueError when malformed. A
    bare IPv6 address (two colons or more) takes `port`."""
    if node.startswith("["):
        host, sep, rest = node[1:].partition("]:")
        if not sep:
            raise ValueError(f"node {node!r}: write [address]:port")
    elif node.count(":") == 1:
        host, sep, rest = node.partition(":")
    else:
        host, sep, rest = node, "", ""
    if not host or any(c.isspace() for c in host) or (sep and not rest.isdigit()):
        raise ValueError(f"node {node!r}: a host name or address, optionally :port")
    number = int(rest) if sep else port
    if not 1 <= number <= 65535:
        raise ValueError(f"node {node!r}: port out of range")
    return host, number
