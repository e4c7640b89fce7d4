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
  the gate is busy), save for yields made while connections were closing anyway.

State changes only in the synchronous methods below; the host pools do the I/O.
"""

from __future__ import annotations

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
        """Close `conn` (one of `evictable()`'s) and report it through `closed()` when done."""
        ...

    def holds(self) -> tuple[int, int]:
        """(connections with a channel in use, idle connections) held now."""
        ...


class Sshd:
    """The handshake gate and the connection budget of one sshd."""

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

    def join(self, member: Member, max_handshakes: int, max_total_connections: float) -> None:
        """A new account reaches this sshd: the strictest limits of all its accounts apply."""
        self.members.append(member)
        self.max_handshakes = min(self.max_handshakes, max_handshakes)
        self.max_total_connections = min(self.max_total_connections, max_total_connections)

    def has_room(self) -> bool:
        """A connection could open now without closing another."""
        return self.held + self.connecting < self.max_total_connections

    def has_spare_room(self, member: Member) -> bool:
        """A connection could open now without closing another, and without taking the room
        of an account queued for a turn (a connection kept only for min_connections waits for
        spare room: it would be closed again for the next account)."""
        others = len(self.ring) - (1 if self.is_queued(member) else 0)
        return self.held + self.connecting + others < self.max_total_connections

    def is_queued(self, member: Member) -> bool:
        return id(member) in self.queued

    def owes_room(self, member: Member) -> bool:
        """Should `member` yield a connection to an account waiting for its turn? While the
        sshd is full, another account waits, and fewer closes for room are under way than
        accounts waiting and handshakes that could then start."""
        waiting = len(self.ring) - (1 if self.is_queued(member) else 0)
        room_coming = min(waiting, self.max_handshakes)
        return not self.has_room() and self.evicting < room_coming

    # ---- state changes: synchronous, no awaits ----

    def want(self, member: Member) -> None:
        """`member` needs a connection: queue it for a turn (once) and serve the ring."""
        if id(member) not in self.queued:
            self.queued[id(member)] = time.monotonic()
            self.ring.append(member)
        self.dispatch()

    def dispatch(self) -> None:
        """Grant handshakes to the accounts in the ring, one per turn, making room by evicting
        idle connections of other accounts when the sshd holds its maximum."""
        while self.ring and self.connecting < self.max_handshakes and not self.stopped:
            member = self.ring[0]
            if not member.wants_connection():
                self._leave()
                continue
            if self.held + self.connecting >= self.max_total_connections:
                # Full: close the least recently used idle connection, then grant once closed.
                if self.evicting < self.max_handshakes and self._evict(member):
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

    def closed(self, evicted: bool = False) -> None:
        """A held connection is closed (its close is done)."""
        self.held -= 1
        if evicted:
            self.evicting -= 1
        self.dispatch()

    def _leave(self) -> float:
        """Take the ring's head out; returns since when it waited."""
        return self.queued.pop(id(self.ring.popleft()))

    def _evict(self, served: Member) -> bool:
        """Close the least recently used idle connection of an account other than `served`;
        False when there is none (every connection has a channel in use)."""
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
            "counters": dict(self.counters),
        }
