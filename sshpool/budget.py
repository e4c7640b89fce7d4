"""One sshd's budget, shared by every account that reaches it (docs/pool.md, "One sshd, many
accounts").

sshd's admission limits are per daemon (`MaxStartups`) or per source address, never per
account, so the pool counts handshakes and connections per sshd: the resolved address and port
connected to, whatever account or host name reaches it. The host pools (`sshpool.host`, one per
Target) ask their sshd for a handshake when they need one more connection, and the sshd grants
them in turns.

Invariants of an sshd budget:
- connecting <= max_handshakes (the handshake gate, counted over all accounts);
- held + connecting <= max_total_connections, where `held` counts every connection made and not
  yet closed (pooled, or closing);
- accounts needing a connection wait in a ring and get one handshake each per turn (round
  robin), so one account's backlog delays another's first connection by one turn at most;
- a connection only to keep an account's min_connections opens only in spare room: never by
  closing another's, nor in room an account queued for a turn needs;
- to make room, the idle connection (no channel in use) of another account that was used
  least recently is closed; a connection with a channel in use is never closed for room;
- while accounts wait for a turn at a full sshd, an account with a backlog yields its
  connections beyond its first: each takes no new channel and closes once its channels end;
- evicting <= max_handshakes: closes for room at once (evictions and yields) are no more than
  the handshakes that could start when they are done (the next ones are made ready while
  the gate is busy), save for yields made while connections were closing anyway, and closes
  down to a lowered share (below).

Several processes reaching one sshd (API workers and replicas) share its gate and budget
through a `Coordinator`: it sets this process's share (`allow`), and the gate and budget above
are then `gate()` and `budget()`, the lesser of the sshd's limit and the share. A share
lowered below what the process holds closes idle connections, least recently used first, and
makes busy ones yield (each closes once its channels end), down to the share. Another
process may ask for the room of one idle connection of this one (the least recently used of
the sshd's, `lend`): it closes if still idle, and its room is no longer this process's
(`budget`). A coordinator that expects slots of the sshd to be free (`room_coming`) has a full
share wait for it rather than close an idle connection of its own. Without a coordinator the
process owns the whole budget; `StaticShare` gives it budget / processes.

State changes only in the synchronous methods below; the host pools do the I/O.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from typing import Any, Protocol

from sshpool.breaker import Penalties


class Member(Protocol):
    """What the budget needs of a host pool (`sshpool.host.HostPool`)."""

    def wants_connection(self) -> bool:
        """True while the account needs one more connection and may open it (its own
        max_connections, its waiters, its breaker)."""
        ...

    def start_connect(self) -> None:
        """A handshake was granted: count it and start it (in the background)."""
        ...

    def evictable(self) -> list[tuple[float, Any]]:
        """(idle since, connection) of each idle connection that could be closed for room."""
        ...

    def evict(self, conn: Any) -> None:
        """Close `conn` (one of `evictable()`'s, each with an `ident` unique in the process) and
        report it through `closed()` when done."""
        ...

    def holds(self) -> tuple[int, int]:
        """(connections with a channel in use, idle connections) held now."""
        ...


class Coordinator(Protocol):
    """How the processes reaching one sshd split its gate and budget (docs/pool.md, "Many
    processes, one sshd"). The sshd reports each change of its use or its demand (`changed`:
    synchronous and cheap, no I/O); the coordinator sets its share (`Sshd.allow`), at once or
    later (a lease taken elsewhere, in the background)."""

    def attach(self, sshd: Sshd) -> None:
        """A new sshd of this process: set its share before its first grant."""
        ...

    def changed(self, sshd: Sshd) -> None:
        """Its use or demand changed (see `Sshd.demand`)."""
        ...


def static_share(total: float, processes: int) -> float:
    """One process's static share of an sshd's `total`: total / processes, rounded down, at
    least 1 (an unlimited total stays unlimited)."""
    if math.isinf(total):
        return total
    return max(1, int(total) // max(1, processes))


class StaticShare:
    """`processes` processes reach each sshd and know nothing of each other: each keeps
    budget / processes connections and gate / processes handshakes (`static_share`), so their
    sum stays within the sshd's limits."""

    def __init__(self, processes: int) -> None:
        self.processes = processes

    def attach(self, sshd: Sshd) -> None:
        sshd.share_mode = "static"
        self.changed(sshd)

    def changed(self, sshd: Sshd) -> None:
        # The sshd's limits may fall as accounts join (the strictest applies): follow them.
        handshakes = static_share(sshd.max_handshakes, self.processes)
        connections = static_share(sshd.max_total_connections, self.processes)
        if (handshakes, connections) != (sshd.share_handshakes, sshd.share_connections):
            sshd.allow(handshakes, connections)


class Sshd:
    """The handshake gate and the connection budget of one sshd (this process's share)."""

    def __init__(self, key: str, max_handshakes: int, max_total_connections: float) -> None:
        self.key = key
        self.max_handshakes = max_handshakes
        self.max_total_connections = max_total_connections
        self.members: list[Member] = []
        self.connecting = 0
        self.held = 0
        self.evicting = 0
        self.ring: deque[Member] = deque()
        # id() of each member in the ring -> since when it waits for a grant.
        self.queued: dict[int, float] = {}
        self.counters: Counter[str] = Counter()
        self.wait_seconds = 0.0
        self.max_held = 0
        # Set when the pool closes: no grant any more.
        self.stopped = False
        # The refused logins of all its accounts, kept under its PerSourcePenalties threshold
        # (the pool sets the figures from the first account's Limits).
        self.penalties = Penalties()
        # This process's share of the gate and of the budget (`allow`), what sets it, and the
        # figures the coordinator knows of the whole sshd (for stats).
        self.share_handshakes = math.inf
        self.share_connections = math.inf
        self.share_mode = "process"
        self.coordinator: Coordinator | None = None
        self.shared: dict[str, Any] = {}
        # Idents of the idle connections closing at another process's request (`lend`): their
        # room is that process's already, not this one's.
        self.lending: set[int] = set()
        # Set by a coordinator while the sshd has slots no process holds: a full share then
        # waits for the coordinator to grow it rather than close an idle connection here.
        self.room_coming = False

    def coordinate(self, coordinator: Coordinator) -> None:
        """Share this sshd with other processes through `coordinator` (before the first grant)."""
        self.coordinator = coordinator
        coordinator.attach(self)

    def gate(self) -> float:
        """Handshakes this process may have in flight: the sshd's gate, or its share of it."""
        return min(self.max_handshakes, self.share_handshakes)

    def budget(self) -> float:
        """Connections this process may hold: the sshd's budget, or its share of it, less the
        room it lends (connections closing for another process)."""
        return min(self.max_total_connections, self.share_connections) - len(self.lending)

    def demand(self) -> tuple[int, int, int, int]:
        """(handshakes in flight, handshakes wanted, connections held, connections wanted):
        what a coordinator leases for. Wanted: those in flight and one per account waiting for
        a turn (up to the gate); connections with a channel in use, those being made and one
        per account waiting. Idle connections are held but not wanted: another process may
        have their room."""
        waiting = len(self.ring)
        busy = sum(member.holds()[0] for member in self.members)
        used = self.held + self.connecting
        handshakes = self.connecting + min(waiting, max(0, self.max_handshakes - self.connecting))
        return self.connecting, handshakes, used, min(used, busy + self.connecting) + waiting

    def join(self, member: Member, max_handshakes: int, max_total_connections: float) -> None:
        """A new account reaches this sshd: the strictest limits of all its accounts apply."""
        self.members.append(member)
        self.max_handshakes = min(self.max_handshakes, max_handshakes)
        self.max_total_connections = min(self.max_total_connections, max_total_connections)
        self._changed()

    def over_share(self) -> bool:
        """More connections held than this process's share, beyond those already closing."""
        return self.held + self.connecting - self.evicting > self.budget()

    def has_room(self) -> bool:
        """A connection could open now without closing another."""
        return self.held + self.connecting < self.budget()

    def has_spare_room(self, member: Member) -> bool:
        """A connection could open now without closing another, and without taking the room
        of an account queued for a turn (a connection kept only for min_connections waits for
        spare room: it would be closed again for the next account)."""
        others = len(self.ring) - (1 if self.is_queued(member) else 0)
        return self.held + self.connecting + others < self.budget()

    def is_queued(self, member: Member) -> bool:
        return id(member) in self.queued

    def owes_room(self, member: Member, open_conns: int) -> bool:
        """Should `member`, holding `open_conns` connections, yield one? Over this process's
        share: yes, any. Otherwise its connections beyond its first, while the sshd is full,
        another account waits, and fewer closes for room are under way than accounts waiting
        and handshakes that could then start."""
        if self.over_share():
            return True
        waiting = len(self.ring) - (1 if self.is_queued(member) else 0)
        room_coming = min(waiting, self.gate())
        return open_conns > 1 and not self.has_room() and self.evicting < room_coming

    # ---- state changes: synchronous, no awaits ----

    def allow(self, handshakes: float, connections: float) -> None:
        """The coordinator sets this process's share: grant what it lets through now, or close
        idle connections down to it (busy ones yield: `owes_room`)."""
        self.share_handshakes = handshakes
        self.share_connections = connections
        self.dispatch()

    def want(self, member: Member) -> None:
        """`member` needs a connection: queue it for a turn (once) and serve the ring."""
        if id(member) not in self.queued:
            self.queued[id(member)] = time.monotonic()
            self.ring.append(member)
        self.dispatch()

    def dispatch(self) -> None:
        """Grant handshakes to the accounts in the ring, one per turn, making room by evicting
        idle connections of other accounts when the sshd holds its maximum."""
        while self.over_share() and self._evict(None):
            pass
        while self.ring and self.connecting < self.gate() and not self.stopped:
            member = self.ring[0]
            if not member.wants_connection():
                self._leave()
                continue
            if self.held + self.connecting >= self.budget():
                # Full: close the least recently used idle connection, then grant once closed
                # (unless the share may grow into free slots of the sshd first).
                if not self.room_coming and self.evicting < self.gate() and self._evict(member):
                    continue
                break
            since = self._leave()
            self.wait_seconds += time.monotonic() - since
            self.connecting += 1
            self.counters["handshakes_granted"] += 1
            member.start_connect()
            if member.wants_connection():
                self.queued[id(member)] = time.monotonic()
                self.ring.append(member)
        self._changed()

    def _changed(self) -> None:
        if self.coordinator is not None:
            self.coordinator.changed(self)

    def idle(self) -> None:
        """A connection's last channel ended: accounts waiting for a turn at a full sshd may
        have its room now (else they would wait for the next grant, close or maintenance)."""
        if self.ring:
            self.dispatch()

    def yielded(self) -> None:
        """A member retires a connection for room (see `owes_room`)."""
        self.evicting += 1
        self.counters["yields"] += 1

    def connected(self, ok: bool) -> None:
        """A granted handshake ended: a connection held more, or none."""
        self.connecting -= 1
        if ok:
            self.held += 1
            self.max_held = max(self.max_held, self.held)
        self._changed()

    def closed(self, evicted: bool = False, ident: int | None = None) -> None:
        """A held connection (`ident`) is closed (its close is done)."""
        self.held -= 1
        if evicted:
            self.evicting -= 1
        if ident in self.lending:
            # Its room goes to the process that asked: this share is one less until the
            # coordinator's next lease says so itself.
            self.lending.discard(ident)
            self.share_connections -= 1
        self.dispatch()

    def idle_connections(self) -> list[tuple[float, int]]:
        """(idle since, ident) of each idle connection of this process (no channel in use):
        what a coordinator offers other processes, least recently used first (`lend`)."""
        return sorted(
            (since, conn.ident) for member in self.members for since, conn in member.evictable()
        )

    def lend(self, ident: int) -> bool:
        """Another process asked for the room of idle connection `ident` (the least recently
        used anywhere): close it if it still is idle, its room no longer this process's (see
        `budget`). False: it has a channel in use again, or is gone; nothing is closed."""
        for member in self.members:
            for _, conn in member.evictable():
                if conn.ident == ident:
                    self.lending.add(ident)
                    self.evicting += 1
                    self.counters["lent"] += 1
                    member.evict(conn)
                    self._changed()
                    return True
        return False

    def _leave(self) -> float:
        """Take the ring's head out; returns since when it waited."""
        return self.queued.pop(id(self.ring.popleft()))

    def _evict(self, served: Member | None) -> bool:
        """Close the least recently used idle connection of an account other than `served`
        (None: of any account); False when there is none (every connection has a channel in
        use)."""
        best: tuple[float, Any, Member] | None = None
        for member in self.members:
            if member is served:
                continue
            for since, conn in member.evictable():
                if best is None or since < best[0]:
                    best = (since, conn, member)
        if best is None:
            return False
        self.evicting += 1
        self.counters["evictions"] += 1
        best[2].evict(best[1])
        return True

    # ---- reading ----

    def stats(self) -> dict[str, Any]:
        busy = idle = 0
        accounts = 0
        for member in self.members:
            b, i = member.holds()
            busy, idle = busy + b, idle + i
            accounts += 1 if b + i else 0
        return {
            "sshd": self.key,
            "max_total_connections": (
                None if math.isinf(self.max_total_connections) else self.max_total_connections
            ),
            "max_handshakes": self.max_handshakes,
            "connections_busy": busy,
            "connections_idle": idle,
            "connections_closing": self.held - busy - idle,
            "connections_max": self.max_held,
            "handshakes_in_flight": self.connecting,
            "handshakes_queued": len(self.ring),
            "accounts_holding": accounts,
            "accounts": len(self.members),
            "connection_wait_seconds": self.wait_seconds,
            # The refused logins sshd's PerSourcePenalties would count against this address,
            # and what it holds against it now (seconds; on the pool's loop clock).
            "logins_refused": self.penalties.refused,
            "penalty_seconds": round(self.penalties.score(_loop_time()), 3),
            "penalty_threshold": self.penalties.threshold,
            "share_mode": self.share_mode,
            "share_handshakes": _finite(self.gate()),
            "share_connections": _finite(self.budget()),
            "shared": dict(self.shared),
            "counters": dict(self.counters),
        }


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # stats read outside the pool's loop: no penalty drains
        return math.inf


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value
